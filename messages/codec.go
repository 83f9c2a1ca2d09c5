package messages

import (
	"errors"
	"fmt"
	"slices"

	"github.com/tinylib/msgp/msgp"
	"github.com/vmihailenco/msgpack/v5"
)

// MaxMessageBytes is the largest payload a decoder accepts. It is above the
// largest message kvbus produces (a 128k-token ReqMeta is about 1.5 MiB) and
// below what would let one message exhaust a process.
const MaxMessageBytes = 8 << 20

// maxNesting bounds how deeply maps and arrays may nest in a message,
// counting the message's own map as level 1. It is above what any kvbus
// message needs (free-form Args are limited to maxArgsDepth below the
// message's second level).
const maxNesting = 32

// MaxArrayLen and MaxMapLen bound the arrays and maps of a message's typed
// fields, as the //msgp:limit directive in types.go says (a decoder
// refuses more; byte strings are bounded by MaxMessageBytes instead). A
// producer checks what a client sent against them.
const (
	MaxArrayLen = 262144
	MaxMapLen   = 65536
)

// MaxPoolBlockBytes bounds the size of one block a PoolPart may announce
// (a Llama-3.1-70B block of 16 tokens at TP 1 is 5 MiB).
const MaxPoolBlockBytes = 64 << 20

// Sentinel errors.
var (
	// ErrMalformed is wrapped by every decode error: the payload is not a
	// valid message of the expected type.
	ErrMalformed = errors.New("messages: malformed message")
	// ErrTooLarge is wrapped when a payload exceeds MaxMessageBytes.
	ErrTooLarge = errors.New("messages: message too large")
	// ErrInvalid is wrapped when a message decodes but breaks a rule of the
	// contract, such as a missing request id.
	ErrInvalid = errors.New("messages: invalid message")
)

// Message is implemented by the pointer of every wire type; the msgp
// methods are generated (types_gen.go).
type Message interface {
	setVersion()
	validate() error
	msgp.Marshaler
	msgp.Sizer
}

func (m *Request) setVersion()       { m.V = Version }
func (m *ReqMeta) setVersion()       { m.V = Version }
func (m *RankResult) setVersion()    { m.V = Version }
func (m *Output) setVersion()        { m.V = Version }
func (m *KVEventBatch) setVersion()  { m.V = Version }
func (m *Heartbeat) setVersion()     { m.V = Version }
func (m *Abort) setVersion()         { m.V = Version }
func (m *Announcement) setVersion()  { m.V = Version }
func (m *SavePlan) setVersion()      { m.V = Version }
func (m *PoolRead) setVersion()      { m.V = Version }
func (m *PoolPart) setVersion()      { m.V = Version }
func (m *DrainPlan) setVersion()     { m.V = Version }
func (m *Handoff) setVersion()       { m.V = Version }
func (m *HandoffResult) setVersion() { m.V = Version }
func (m *Resend) setVersion()        { m.V = Version }
func (m *ResendReply) setVersion()   { m.V = Version }

// Marshal encodes m as a msgpack map, setting its version field. The
// returned slice is owned by the caller.
func Marshal(m Message) ([]byte, error) {
	m.setVersion()
	// Msgsize bounds the encoding from above (free-form Args only
	// estimate theirs): one allocation.
	b, err := m.MarshalMsg(make([]byte, 0, m.Msgsize()))
	if err != nil {
		return nil, fmt.Errorf("messages: encode %T: %w", m, err)
	}
	return b, nil
}

// decode unmarshals data into m and validates it. It never panics.
func decode(data []byte, m Message) error {
	if err := Unmarshal(data, m); err != nil {
		return err
	}
	return m.validate()
}

// Unmarshal decodes msgpack data into v (any msgpack-tagged type) with the
// defences every kvbus decoder has: a size limit, a nesting limit and no
// panics. Errors wrap ErrTooLarge or ErrMalformed.
func Unmarshal(data []byte, v any) (err error) {
	if len(data) > MaxMessageBytes {
		return fmt.Errorf("%w: %d bytes (limit %d)", ErrTooLarge, len(data), MaxMessageBytes)
	}
	// The msgpack library skips unknown keys recursively and without a depth
	// limit, so a deeply nested unknown value would overflow the goroutine
	// stack (a fatal error that recover cannot catch). Check the nesting
	// first, without recursion.
	if err := checkNesting(data, maxNesting); err != nil {
		return fmt.Errorf("%T: %w", v, err)
	}
	defer func() {
		// The msgpack library is not fuzzed by its authors against every
		// input; a panic in it must not take a process down.
		if r := recover(); r != nil {
			err = fmt.Errorf("%w: %T: decoder panic: %v", ErrMalformed, v, r)
		}
	}()
	if u, ok := v.(msgp.Unmarshaler); ok { // every wire type (types_gen.go)
		if _, err := u.UnmarshalMsg(data); err != nil {
			if errors.Is(err, ErrMalformed) {
				return fmt.Errorf("%T: %w", v, err)
			}
			return fmt.Errorf("%w: %T: %v", ErrMalformed, v, err)
		}
		return nil
	}
	if err := msgpack.Unmarshal(data, v); err != nil {
		if errors.Is(err, ErrMalformed) {
			return fmt.Errorf("%T: %w", v, err)
		}
		return fmt.Errorf("%w: %T: %v", ErrMalformed, v, err)
	}
	return nil
}

// DecodeRequest decodes and validates a Request.
func DecodeRequest(data []byte) (*Request, error) {
	var m Request
	return &m, decode(data, &m)
}

// DecodeReqMeta decodes and validates a ReqMeta.
func DecodeReqMeta(data []byte) (*ReqMeta, error) {
	var m ReqMeta
	return &m, decode(data, &m)
}

// DecodeRankResult decodes and validates a RankResult.
func DecodeRankResult(data []byte) (*RankResult, error) {
	var m RankResult
	return &m, decode(data, &m)
}

// DecodeOutput decodes and validates an Output.
func DecodeOutput(data []byte) (*Output, error) {
	var m Output
	return &m, decode(data, &m)
}

// DecodeKVEventBatch decodes and validates a KVEventBatch.
func DecodeKVEventBatch(data []byte) (*KVEventBatch, error) {
	var m KVEventBatch
	return &m, decode(data, &m)
}

// DecodeHeartbeat decodes and validates a Heartbeat.
func DecodeHeartbeat(data []byte) (*Heartbeat, error) {
	var m Heartbeat
	return &m, decode(data, &m)
}

// DecodeAbort decodes and validates an Abort.
func DecodeAbort(data []byte) (*Abort, error) {
	var m Abort
	return &m, decode(data, &m)
}

// DecodeAnnouncement decodes and validates an Announcement.
func DecodeAnnouncement(data []byte) (*Announcement, error) {
	var m Announcement
	return &m, decode(data, &m)
}

// DecodeSavePlan decodes and validates a SavePlan.
func DecodeSavePlan(data []byte) (*SavePlan, error) {
	var m SavePlan
	return &m, decode(data, &m)
}

// DecodePoolRead decodes and validates a PoolRead.
func DecodePoolRead(data []byte) (*PoolRead, error) {
	var m PoolRead
	return &m, decode(data, &m)
}

// DecodePoolPart decodes and validates a PoolPart.
func DecodePoolPart(data []byte) (*PoolPart, error) {
	var m PoolPart
	return &m, decode(data, &m)
}

// DecodeDrainPlan decodes and validates a DrainPlan.
func DecodeDrainPlan(data []byte) (*DrainPlan, error) {
	var m DrainPlan
	return &m, decode(data, &m)
}

// DecodeHandoff decodes and validates a Handoff.
func DecodeHandoff(data []byte) (*Handoff, error) {
	var m Handoff
	return &m, decode(data, &m)
}

// DecodeResend decodes and validates a Resend.
func DecodeResend(data []byte) (*Resend, error) {
	var m Resend
	return &m, decode(data, &m)
}

// DecodeResendReply decodes and validates a ResendReply.
func DecodeResendReply(data []byte) (*ResendReply, error) {
	var m ResendReply
	return &m, decode(data, &m)
}

// DecodeHandoffResult decodes and validates a HandoffResult.
func DecodeHandoffResult(data []byte) (*HandoffResult, error) {
	var m HandoffResult
	return &m, decode(data, &m)
}

func invalid(format string, args ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{ErrInvalid}, args...)...)
}

func (m *Request) validate() error {
	switch {
	case m.RequestID == "":
		return invalid("request without request_id")
	case m.FrontendID == "" || !isToken(m.FrontendID):
		return invalid("request %s: frontend_id %q is not a subject token", m.RequestID, m.FrontendID)
	case m.SamplingParams.MaxTokens < 0:
		return invalid("request %s: negative max_tokens", m.RequestID)
	case !jsonObject(m.Body):
		return invalid("request %s: body is not a JSON object", m.RequestID)
	case m.Endpoint != "" && m.Endpoint != EndpointChat && m.Endpoint != EndpointCompletions:
		return invalid("request %s: endpoint %q is not %s or %s", m.RequestID, m.Endpoint, EndpointChat, EndpointCompletions)
	case CheckSessionID(m.SessionID) != nil:
		return invalid("request %s: session_id: %v", m.RequestID, CheckSessionID(m.SessionID))
	case CheckSessionID(m.SamplingParams.SessionFromExtraArgs()) != nil:
		return invalid("request %s: extra_args session_id: %v", m.RequestID, CheckSessionID(m.SamplingParams.SessionFromExtraArgs()))
	case len(m.CacheSalt) > MaxCacheSaltBytes:
		return invalid("request %s: cache_salt of %d bytes; at most %d", m.RequestID, len(m.CacheSalt), MaxCacheSaltBytes)
	case len(m.LoRAName) > MaxLoRANameBytes:
		return invalid("request %s: lora_name of %d bytes; at most %d", m.RequestID, len(m.LoRAName), MaxLoRANameBytes)
	}
	return nil
}

// MaxLoRANameBytes bounds a request's lora_name, a model name as an
// engine lists it (a Hugging Face id or a path).
const MaxLoRANameBytes = 1024

// MaxCacheSaltBytes bounds a request's cache_salt. vLLM sets no bound; a
// salt is a secret of some 43 characters (256 bits in base64), and 1 KiB
// leaves room for any encoding of one.
const MaxCacheSaltBytes = 1024

// jsonObject reports whether b is empty or starts like a JSON object (the
// engine parses it; kvbus only forwards it).
func jsonObject(b []byte) bool {
	for _, c := range b {
		switch c {
		case ' ', '\t', '\r', '\n':
			continue
		}
		return c == '{'
	}
	return true
}

func (m *ReqMeta) validate() error {
	switch {
	case m.ReqID == "":
		return invalid("req_meta without req_id")
	case ValidateGroup(m.Group) != nil:
		return invalid("req_meta %s: %v", m.ReqID, ValidateGroup(m.Group))
	case m.BlockSize <= 0:
		return invalid("req_meta %s: block_size %d", m.ReqID, m.BlockSize)
	case m.Attempt < 0:
		return invalid("req_meta %s: negative attempt %d", m.ReqID, m.Attempt)
	case m.TokenLen != len(m.TokenIDs):
		return invalid("req_meta %s: token_len %d but %d token ids", m.ReqID, m.TokenLen, len(m.TokenIDs))
	case len(m.BlockHashes) > len(m.TokenIDs)/m.BlockSize:
		return invalid("req_meta %s: %d block hashes for %d tokens", m.ReqID, len(m.BlockHashes), len(m.TokenIDs))
	case m.SaveFromBlock < 0 || m.SaveFromBlock > len(m.BlockHashes):
		return invalid("req_meta %s: save_from_block %d out of range", m.ReqID, m.SaveFromBlock)
	case m.LoadSpec != nil && (m.LoadSpec.KVPoolCachedTokens < 0 || m.LoadSpec.KVPoolCachedTokens > m.TokenLen):
		return invalid("req_meta %s: kvpool_cached_tokens %d out of range", m.ReqID, m.LoadSpec.KVPoolCachedTokens)
	case m.LoadSpec != nil && m.LoadSpec.KVPoolCachedTokens > len(m.BlockHashes)*m.BlockSize:
		// The tokens loaded are those of whole blocks named by their hashes.
		return invalid("req_meta %s: kvpool_cached_tokens %d beyond the %d blocks of %d tokens hashed", m.ReqID,
			m.LoadSpec.KVPoolCachedTokens, len(m.BlockHashes), m.BlockSize)
	case m.LoadSpec != nil && !validRuns(m.LoadSpec.Remote, m.LoadSpec.KVPoolCachedTokens/m.BlockSize):
		return invalid("req_meta %s: remote runs %+v outside the %d blocks to load", m.ReqID, m.LoadSpec.Remote, m.LoadSpec.KVPoolCachedTokens/m.BlockSize)
	case m.FrontendID == "" || !isToken(m.FrontendID):
		return invalid("req_meta %s: frontend_id %q is not a subject token", m.ReqID, m.FrontendID)
	case m.ResultSubject == "":
		return invalid("req_meta %s: no result_subject", m.ReqID)
	case len(m.CacheSalt) > MaxCacheSaltBytes:
		return invalid("req_meta %s: cache_salt of %d bytes; at most %d", m.ReqID, len(m.CacheSalt), MaxCacheSaltBytes)
	case !jsonObject(m.Body):
		return invalid("req_meta %s: body is not a JSON object", m.ReqID)
	case m.Endpoint != "" && m.Endpoint != EndpointChat && m.Endpoint != EndpointCompletions:
		return invalid("req_meta %s: endpoint %q is not %s or %s", m.ReqID, m.Endpoint, EndpointChat, EndpointCompletions)
	}
	return nil
}

// validRuns reports whether remote runs lie within the first n blocks, in
// order, without overlap, each from a valid group with at most
// MaxRunAlternates valid alternates, none of them the run's group.
func validRuns(runs []RemoteRun, n int) bool {
	next := 0
	for _, r := range runs {
		if ValidateGroup(r.Group) != nil || r.Blocks < 1 || r.FromBlock < next || r.FromBlock > n || r.Blocks > n-r.FromBlock ||
			len(r.Alternates) > MaxRunAlternates {
			return false
		}
		for i, a := range r.Alternates {
			if ValidateGroup(a) != nil || a == r.Group || slices.Contains(r.Alternates[:i], a) {
				return false
			}
		}
		next = r.FromBlock + r.Blocks
	}
	return true
}

func (m *RankResult) validate() error {
	switch {
	case m.ReqID == "":
		return invalid("rank_result without req_id")
	case m.TPRank < 0 || m.EPRank < 0 || m.Attempt < 0:
		return invalid("rank_result with a negative tp_rank, ep_rank or attempt")
	case m.LoadedTokens < 0 || m.RemoteTokens < 0 || m.CompletionTokens < 0 ||
		m.StoredBlocks < 0 || m.SkippedBlocks < 0 || m.FailedBlocks < 0:
		return invalid("rank_result with a negative token or block count")
	case m.RemoteTokens > m.LoadedTokens:
		return invalid(fmt.Sprintf("rank_result with remote_tokens %d above loaded_tokens %d (remote tokens are among those loaded)", m.RemoteTokens, m.LoadedTokens))
	}
	return nil
}

func (m *Output) validate() error {
	switch u := m.Usage; {
	case m.ReqID == "":
		return invalid("output without req_id")
	case m.Index < 0 || m.Attempt < 0:
		return invalid("output of %s with index %d, attempt %d: neither may be negative", m.ReqID, m.Index, m.Attempt)
	case u != nil && (u.PromptTokens < 0 || u.CompletionTokens < 0 || u.CachedTokens < 0 || u.RemoteCachedTokens < 0):
		return invalid("output of %s with a negative token count in its usage %+v", m.ReqID, *u)
	}
	return nil
}

func (m *KVEventBatch) validate() error {
	if m.DumpChunk < 0 || m.DumpChunks < 0 || m.DumpChunks > MaxDumpChunks || (m.DumpChunks > 0 && m.DumpChunk >= m.DumpChunks) {
		return invalid("kv event batch: dump chunk %d of %d", m.DumpChunk, m.DumpChunks)
	}
	for i, ev := range m.Events {
		switch ev.Type {
		case EventBlockStored, EventBlockRemoved, EventAllBlocksCleared:
		default:
			return invalid("kv event %d: unknown type %q", i, ev.Type)
		}
	}
	return nil
}

func (m *Heartbeat) validate() error {
	switch {
	case ValidateGroup(m.Group) != nil:
		return invalid("heartbeat: %v", ValidateGroup(m.Group))
	case m.WorldSize <= 0 || m.TPRank < 0 || m.TPRank >= m.WorldSize:
		return invalid("heartbeat from %s: tp_rank %d of world_size %d", m.Group, m.TPRank, m.WorldSize)
	}
	return nil
}

func (m *Abort) validate() error {
	switch {
	case m.ReqID == "":
		return invalid("abort without req_id")
	case m.BeforeAttempt < 0:
		return invalid("abort of %s: negative before_attempt %d", m.ReqID, m.BeforeAttempt)
	}
	return nil
}

func (m *Announcement) validate() error {
	switch {
	case m.Role == "" || !isToken(m.Role):
		return invalid("announcement: role %q is not a subject token", m.Role)
	case m.ID == "" || !isToken(m.ID):
		return invalid("announcement from %s: id %q is not a subject token", m.Role, m.ID)
	}
	return nil
}

func (m *SavePlan) validate() error {
	if m.Group == "" && m.ReqID == "" && len(m.BlockHashes) == 0 && len(m.Ended) > 0 {
		return nil // only the requests a replica ended
	}
	if err := ValidateGroup(m.Group); err != nil {
		return invalid("save_plan %s: %v", m.ReqID, err)
	}
	return nil
}

func (m *PoolRead) validate() error {
	if m.Model == "" || m.TPRank < 0 {
		return invalid("pool_read: model %q, tp_rank %d", m.Model, m.TPRank)
	}
	return nil
}

func (m *PoolPart) validate() error {
	if m.Parts < 1 || m.Part < 0 || m.Part >= m.Parts {
		return invalid("pool_part: part %d of %d", m.Part, m.Parts)
	}
	for i, p := range m.Pieces {
		if p.Index < 0 || p.Offset < 0 || p.Size < 0 || p.Size > MaxPoolBlockBytes || p.Offset > p.Size || len(p.Data) > p.Size-p.Offset {
			return invalid("pool_part: piece %d: index %d, bytes %d+%d of %d", i, p.Index, p.Offset, len(p.Data), p.Size)
		}
	}
	return nil
}

func (m *DrainPlan) validate() error {
	if err := ValidateGroup(m.Group); err != nil {
		return invalid("drain_plan: %v", err)
	}
	if m.Model == "" {
		return invalid("drain_plan of %s: no model", m.Group)
	}
	for _, t := range m.Targets {
		if err := ValidateGroup(t.Group); err != nil {
			return invalid("drain_plan of %s: target: %v", m.Group, err)
		}
	}
	return nil
}

func (m *Handoff) validate() error {
	if err := ValidateGroup(m.Source); err != nil {
		return invalid("handoff: source: %v", err)
	}
	if m.Model == "" || m.TPRank < 0 {
		return invalid("handoff from %s: model %q, tp_rank %d", m.Source, m.Model, m.TPRank)
	}
	return nil
}

func (m *Resend) validate() error {
	switch {
	case m.ReqID == "":
		return invalid("resend without req_id")
	case m.Attempt < 0 || m.FromIndex < 0:
		return invalid("resend of %s: negative attempt %d or from_index %d", m.ReqID, m.Attempt, m.FromIndex)
	}
	return nil
}

func (m *ResendReply) validate() error {
	if m.Resent < 0 {
		return invalid("resend reply: negative resent %d", m.Resent)
	}
	if err := ValidateGroup(m.Group); m.Group != "" && err != nil {
		return invalid("resend reply: %v", err)
	}
	return nil
}

func (m *HandoffResult) validate() error {
	if m.Stored < 0 || m.Failed < 0 || m.Bytes < 0 {
		return invalid("handoff_result: stored %d, failed %d, bytes %d", m.Stored, m.Failed, m.Bytes)
	}
	return nil
}

// checkNesting walks the first msgpack value in data without recursion and
// returns an error wrapping ErrMalformed if maps and arrays nest deeper than
// maxDepth, if the value is truncated, or if it holds the reserved code 0xc1.
// It reads exactly the bytes that msgpack.Unmarshal reads, so it rejects no
// input that would otherwise decode. Because every element of a map or
// array takes at least one byte, it also ensures that no declared length
// exceeds the payload.
func checkNesting(data []byte, maxDepth int) error {
	// remaining[i] is the number of values still to read at level i; level
	// 0 holds the top-level value.
	remaining := make([]uint64, 1, 8)
	remaining[0] = 1
	pos := 0
	need := func(n int) (uint64, error) {
		if n > len(data)-pos {
			return 0, fmt.Errorf("%w: truncated at byte %d", ErrMalformed, pos)
		}
		var v uint64
		for _, b := range data[pos : pos+n] {
			v = v<<8 | uint64(b)
		}
		pos += n
		return v, nil
	}
	for len(remaining) > 0 {
		top := len(remaining) - 1
		if remaining[top] == 0 {
			remaining = remaining[:top]
			continue
		}
		remaining[top]--
		if pos >= len(data) {
			return fmt.Errorf("%w: truncated at byte %d", ErrMalformed, pos)
		}
		c := data[pos]
		pos++
		var (
			items uint64 // elements of a container that follow
			skip  uint64 // bytes of payload that follow, after the length
			err   error
		)
		switch {
		case c <= 0x7f || c >= 0xe0 || c == 0xc0 || c == 0xc2 || c == 0xc3:
			// fixint, nil, false, true
		case c <= 0x8f: // fixmap
			items = 2 * uint64(c&0x0f)
		case c <= 0x9f: // fixarray
			items = uint64(c & 0x0f)
		case c <= 0xbf: // fixstr
			skip = uint64(c & 0x1f)
		default:
			switch c {
			case 0xc4, 0xd9: // bin8, str8
				skip, err = need(1)
			case 0xc5, 0xda: // bin16, str16
				skip, err = need(2)
			case 0xc6, 0xdb: // bin32, str32
				skip, err = need(4)
			case 0xc7, 0xc8, 0xc9: // ext8, ext16, ext32: length, type, data
				skip, err = need(1 << (c - 0xc7))
				skip++
			case 0xca, 0xcb, 0xcc, 0xcd, 0xce, 0xcf, 0xd0, 0xd1, 0xd2, 0xd3:
				skip = [...]uint64{4, 8, 1, 2, 4, 8, 1, 2, 4, 8}[c-0xca]
			case 0xd4, 0xd5, 0xd6, 0xd7, 0xd8: // fixext: type, data
				skip = 1 + 1<<(c-0xd4)
			case 0xdc, 0xdd: // array16, array32
				items, err = need(2 << (c - 0xdc))
			case 0xde, 0xdf: // map16, map32
				items, err = need(2 << (c - 0xde))
				items *= 2
			default: // 0xc1, never used
				return fmt.Errorf("%w: reserved msgpack code 0xc1 at byte %d", ErrMalformed, pos-1)
			}
		}
		if err != nil {
			return err
		}
		if skip > uint64(len(data)-pos) {
			return fmt.Errorf("%w: truncated at byte %d", ErrMalformed, pos)
		}
		pos += int(skip)
		if items > 0 {
			if len(remaining) > maxDepth {
				return fmt.Errorf("%w: nested deeper than %d levels", ErrMalformed, maxDepth)
			}
			if items > uint64(len(data)-pos) {
				return fmt.Errorf("%w: %d elements declared, %d bytes left", ErrMalformed, items, len(data)-pos)
			}
			remaining = append(remaining, items)
		}
	}
	return nil
}
