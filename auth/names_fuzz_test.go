package auth

import (
	"testing"

	"github.com/kvbus/kvbus/messages"
)

// FuzzIdentityNamed: identityNamed reads the seed file names of a key
// directory (Keys), which an operator may have renamed or added to. It
// never panics, reads a name only as the identity whose seed file it is
// (id.Name() is the name), and reads back every identity's own name (of a group Init takes).
func FuzzIdentityNamed(f *testing.F) {
	for _, name := range []string{"admin", "frontend", "scheduler", "worker", "observer", "worker-g0", "worker-g_1-x",
		"admin-old", "worker-", "worker-a.b", "worker-" + string(make([]byte, 33)), "Worker-g0", ""} {
		f.Add(name, "g0")
	}
	f.Fuzz(func(t *testing.T, name, group string) {
		if id, ok := identityNamed(name); ok && id.Name() != name {
			t.Errorf("identityNamed(%q) = %+v, whose seed file is %s.nk", name, id, id.Name())
		}
		for _, id := range Identities([]string{group}) {
			if id.Group != "" && messages.ValidateGroup(id.Group) != nil {
				continue // Init refuses the group
			}
			if got, ok := identityNamed(id.Name()); !ok || got != id {
				t.Errorf("identityNamed(%q) = %+v, %v; want %+v", id.Name(), got, ok, id)
			}
		}
	})
}
