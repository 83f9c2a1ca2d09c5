package messages

import (
	"fmt"
	"testing"
)

func benchTokens(n int) TokenIDs {
	t := make(TokenIDs, n)
	for i := range t {
		t[i] = uint32(i*7919) % 128256 // spread over a Llama-3 sized vocabulary
	}
	return t
}

func benchHashes(n int) BlockHashes {
	h := make(BlockHashes, n)
	x := uint64(0x9e3779b97f4a7c15)
	for i := range h {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		h[i] = x
	}
	return h
}

func BenchmarkRequestEncodeDecode8192(b *testing.B) {
	req := sampleRequest()
	req.PromptTokenIDs = benchTokens(8192)
	data, err := Marshal(req)
	if err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(len(data)))
	b.ReportAllocs()
	for b.Loop() {
		data, err := Marshal(req)
		if err != nil {
			b.Fatal(err)
		}
		got, err := DecodeRequest(data)
		if err != nil {
			b.Fatal(err)
		}
		if len(got.PromptTokenIDs) != 8192 {
			b.Fatalf("%d tokens", len(got.PromptTokenIDs))
		}
	}
}

func BenchmarkReqMetaEncodeDecode8192(b *testing.B) {
	meta := sampleReqMeta()
	meta.TokenIDs = benchTokens(8192)
	meta.TokenLen = 8192
	meta.BlockSize = 16
	meta.BlockHashes = benchHashes(512)
	meta.NumPromptTokens = 8192
	meta.SaveFromBlock = 256
	meta.LoadSpec.KVPoolCachedTokens = 4096
	data, err := Marshal(meta)
	if err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(len(data)))
	b.ReportAllocs()
	for b.Loop() {
		data, err := Marshal(meta)
		if err != nil {
			b.Fatal(err)
		}
		got, err := DecodeReqMeta(data)
		if err != nil {
			b.Fatal(err)
		}
		if len(got.BlockHashes) != 512 {
			b.Fatalf("%d hashes", len(got.BlockHashes))
		}
	}
}

func BenchmarkSessionKey(b *testing.B) {
	ids := make([]string, 64)
	for i := range ids {
		ids[i] = fmt.Sprintf("conversation-%08d-5f2b9c1e-8d7a-4e3b-b1f0", i)
	}
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		if len(SessionKey(ids[i&63])) != 16 {
			b.Fatal("bad key")
		}
		i++
	}
}
