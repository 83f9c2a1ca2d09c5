package scheduler

// groupID numbers a group in the index: bit id%64 of word id/64 in a
// groupMask or a wordMaps value.
type groupID = uint16

func wordBit(id groupID) (word int, bit uint64) { return int(id >> 6), 1 << (id & 63) }

// groupMask is a set of group ids, a bitmask per word of 64 ids.
type groupMask []uint64

func (m groupMask) has(id groupID) bool {
	w, bit := wordBit(id)
	return w < len(m) && m[w]&bit != 0
}

// word returns the ids of word w (0 past the end).
func (m groupMask) word(w int) uint64 {
	if w < len(m) {
		return m[w]
	}
	return 0
}

func (m *groupMask) add(id groupID) {
	w, bit := wordBit(id)
	for len(*m) <= w {
		*m = append(*m, 0)
	}
	(*m)[w] |= bit
}

// wordMaps maps a block hash to a set of group ids: one map per word of 64
// ids, so that up to 64 groups a lookup is one map access per block, and
// each further 64 groups add one.
type wordMaps []map[uint64]uint64

func (wm wordMaps) has(id groupID, h uint64) bool {
	w, bit := wordBit(id)
	return w < len(wm) && wm[w][h]&bit != 0
}

// add puts id into h's set and reports whether h was in no set before.
func (wm *wordMaps) add(id groupID, h uint64) (first bool) {
	w, bit := wordBit(id)
	for len(*wm) <= w {
		*wm = append(*wm, map[uint64]uint64{})
	}
	m := (*wm)[w]
	old, ok := m[h]
	m[h] = old | bit
	return !ok && !wm.inOthers(w, h)
}

// remove takes the ids in bits of word w out of h's set and reports
// whether h is in no set any more (having been in one).
func (wm wordMaps) remove(w int, h uint64, bits uint64) (last bool) {
	if w >= len(wm) {
		return false
	}
	m := wm[w]
	old, ok := m[h]
	if !ok {
		return false
	}
	if f := old &^ bits; f != 0 {
		m[h] = f
		return false
	}
	delete(m, h)
	return !wm.inOthers(w, h)
}

// inOthers reports whether h is in a set of a word other than w.
func (wm wordMaps) inOthers(w int, h uint64) bool {
	for i, m := range wm {
		if i != w {
			if _, ok := m[h]; ok {
				return true
			}
		}
	}
	return false
}
