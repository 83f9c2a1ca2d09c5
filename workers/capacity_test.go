package workers

import "testing"

func TestParseCapacity(t *testing.T) {
	const bpt = 32768 // llama-3.1-8b at TP 4
	for _, tc := range []struct {
		in   string
		want int64
		ok   bool
	}{
		{"1GiB", 1 << 30, true},
		{"64GiB", 64 << 30, true},
		{"512MiB", 512 << 20, true},
		{"1.5KiB", 1536, true},
		{"2GB", 2e9, true},
		{"4096", 4096, true},
		{" 8 MiB ", 8 << 20, true},
		{"4Mtok", 4e6 * bpt, true},
		{"512ktok", 512e3 * bpt, true},
		{"64Ktok", 64e3 * bpt, true}, // K as in KiB: refused before 2026-12-07
		{"100tok", 100 * bpt, true},
		{"", 0, false},
		{"0", 0, false},
		{"-1GiB", 0, false},
		{"lots", 0, false},
		{"NaN", 0, false},
		{"1e30TiB", 0, false},
		{"tok", 0, false},
	} {
		got, err := ParseCapacity(tc.in, bpt)
		if (err == nil) != tc.ok || got != tc.want {
			t.Errorf("ParseCapacity(%q) = %d, %v; want %d, ok=%v", tc.in, got, err, tc.want, tc.ok)
		}
	}
}

func FuzzParseCapacity(f *testing.F) {
	for _, s := range []string{"1GiB", "12.5MB", "7", "x", "1e400", "4Mtok", "Inf"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		n, err := ParseCapacity(s, 64)
		if err == nil && n <= 0 {
			t.Fatalf("ParseCapacity(%q) = %d without error", s, n)
		}
	})
}
