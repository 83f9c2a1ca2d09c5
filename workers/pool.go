package workers

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbus/kvbus/messages"
)

// The KV pool's transport: every rank serves reads
// of its segment — its block store — on kvbus.pool.<group>.<rank>, so that
// rank t of another group can read the blocks rank t of this group holds,
// as Mooncake's store, whose keys name no instance, lets it. Replies are
// chunked to the connection's max payload; a block larger than one reply is
// sent in pieces. Loads read the LoadSpec's remote runs through it
// (rank_load.go), and draining groups hand their blocks off over it
// (drain.go).

// poolPartOverhead is the room a PoolPart needs besides its pieces' bytes.
const poolPartOverhead = 1024

// onPoolRead answers a PoolRead with the blocks this rank holds, in as many
// PoolParts as the connection's max payload needs.
func (r *Rank) onPoolRead(ctx context.Context, m *nats.Msg) error {
	req, err := messages.DecodePoolRead(m.Data)
	if err != nil {
		return err
	}
	if m.Reply == "" {
		return fmt.Errorf("%w: pool read without a reply subject", messages.ErrInvalid)
	}
	keys := make([]string, len(req.BlockHashes))
	for i, h := range req.BlockHashes {
		keys[i] = StoreKey(req.Model, req.TPRank, h)
	}
	values := r.store.BatchGet(ctx, keys)
	// A block this rank is still saving (the turn that just ran here) is
	// sent once saved, within SaveWait, as a local load would wait for it.
	deadline := time.Now().Add(r.cfg.SaveWait)
	for i, v := range values {
		if v == nil && r.awaitSave(keys[i], deadline) {
			values[i] = r.store.BatchGet(ctx, keys[i:i+1])[0]
		}
	}
	parts := poolParts(values, int(r.cfg.Conn.MaxPayload())-poolPartOverhead)
	for i := range parts {
		parts[i].Part, parts[i].Parts = i, len(parts)
		data, err := messages.Marshal(&parts[i])
		if err != nil {
			return err
		}
		if err := r.cfg.Conn.Publish(m.Reply, data); err != nil {
			return fmt.Errorf("answer pool read (part %d of %d): %w", i+1, len(parts), err)
		}
	}
	return nil
}

// poolParts packs the present values (nil: absent) into parts of at most
// budget data bytes each, splitting values that do not fit; there is always
// at least one part.
func poolParts(values [][]byte, budget int) []messages.PoolPart {
	budget = max(budget, 1)
	parts := []messages.PoolPart{{}}
	room := budget
	for i, v := range values {
		if v == nil {
			continue
		}
		for off := 0; off < len(v) || (len(v) == 0 && off == 0); {
			if room == 0 {
				parts = append(parts, messages.PoolPart{})
				room = budget
			}
			n := min(len(v)-off, room)
			last := &parts[len(parts)-1]
			last.Pieces = append(last.Pieces, messages.PoolPiece{Index: i, Offset: off, Size: len(v), Data: v[off : off+n]})
			room -= n
			off += n
			if len(v) == 0 {
				break
			}
		}
	}
	return parts
}

// PoolClient reads blocks from other ranks' segments of the KV pool. Safe
// for concurrent use; Conn is owned by the caller.
type PoolClient struct {
	Conn     *nats.Conn
	Subjects messages.Subjects
}

// ErrPoolRead is wrapped by failed pool reads.
var ErrPoolRead = errors.New("workers: pool read failed")

// Read asks rank rank of group for req's blocks and returns, for each hash,
// its value, or nil when the rank does not hold it (or sent it torn). It
// waits for every part until ctx ends.
func (c PoolClient) Read(ctx context.Context, group string, rank int, req *messages.PoolRead) ([][]byte, error) {
	data, err := messages.Marshal(req)
	if err != nil {
		return nil, err
	}
	inbox := c.Conn.NewRespInbox()
	sub, err := c.Conn.SubscribeSync(inbox)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrPoolRead, err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	if err := c.Conn.PublishRequest(c.Subjects.Pool(group, rank), inbox, data); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrPoolRead, err)
	}
	values := make([][]byte, len(req.BlockHashes))
	filled := make([]int, len(req.BlockHashes))
	var seen []bool
	for got := 0; seen == nil || got < len(seen); {
		msg, err := sub.NextMsgWithContext(ctx)
		if err != nil {
			return nil, fmt.Errorf("%w: %s/%d: %d parts received: %v", ErrPoolRead, group, rank, got, err)
		}
		part, err := messages.DecodePoolPart(msg.Data)
		if err != nil {
			return nil, fmt.Errorf("%w: %s/%d: %v", ErrPoolRead, group, rank, err)
		}
		if seen == nil {
			seen = make([]bool, part.Parts)
		}
		if part.Parts != len(seen) {
			return nil, fmt.Errorf("%w: %s/%d: parts disagree (%d, %d)", ErrPoolRead, group, rank, part.Parts, len(seen))
		}
		if seen[part.Part] {
			continue
		}
		seen[part.Part] = true
		got++
		for _, p := range part.Pieces {
			if p.Index >= len(values) {
				continue
			}
			if values[p.Index] == nil {
				values[p.Index] = make([]byte, p.Size)
			}
			if len(values[p.Index]) != p.Size {
				continue // pieces of one block disagree on its size
			}
			filled[p.Index] += copy(values[p.Index][p.Offset:], p.Data)
		}
	}
	for i, v := range values {
		if v != nil && filled[i] != len(v) {
			values[i] = nil // torn: not every piece arrived
		}
	}
	return values, nil
}
