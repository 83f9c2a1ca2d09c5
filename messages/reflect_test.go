package messages

import "github.com/vmihailenco/msgpack/v5"

// The reflection codec (vmihailenco/msgpack), which wrote kvbus's messages
// before the codec was generated, is the reference the tests hold the
// generated one to. These methods let it write and read the packed lists
// as kvbus does; the product never uses them.

func (t TokenIDs) EncodeMsgpack(enc *msgpack.Encoder) error {
	_, err := enc.Writer().Write(appendPacked(nil, t, hostLittleEndian))
	return err
}

func (t *TokenIDs) DecodeMsgpack(dec *msgpack.Decoder) error {
	raw, err := dec.DecodeRaw()
	if err == nil {
		*t, _, err = readPacked[uint32](raw, "token_ids", hostLittleEndian)
	}
	return err
}

func (h BlockHashes) EncodeMsgpack(enc *msgpack.Encoder) error {
	_, err := enc.Writer().Write(appendPacked(nil, h, hostLittleEndian))
	return err
}

func (h *BlockHashes) DecodeMsgpack(dec *msgpack.Decoder) error {
	raw, err := dec.DecodeRaw()
	if err == nil {
		*h, _, err = readPacked[uint64](raw, "block_hashes", hostLittleEndian)
	}
	return err
}
