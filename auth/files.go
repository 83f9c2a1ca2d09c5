package auth

import (
	"bytes"
	"cmp"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/nats-io/nkeys"

	"github.com/kvbus/kvbus/messages"
)

// ConfigFile is the name of the authorization block Init writes.
const ConfigFile = "nats-auth.conf"

// PrefixFile records, in a key directory, the subject prefix its
// permissions were written for: Rotate and Matrix read it.
const PrefixFile = "subject-prefix"

// ClusterPasswordFile holds, in a key directory, the password NATS servers
// give each other on their routes (`kvbus nats --cluster-password-file`),
// mode 0600. Init writes it when it is missing; Rotate(dir, s,
// ClusterPasswordFile) replaces it.
const ClusterPasswordFile = "cluster-password"

// Identities are the keys Init writes: one per role, and one worker key per
// group of groups.
func Identities(groups []string) []Identity {
	ids := []Identity{{Role: RoleFrontend}, {Role: RoleScheduler}, {Role: RoleWorker}, {Role: RoleObserver}, {Role: RoleAdmin}}
	for _, g := range groups {
		ids = append(ids, Identity{Role: RoleWorker, Group: g})
	}
	return ids
}

// Init writes, into dir, one nkey seed per identity (<name>.nk, mode 0600)
// and ConfigFile, the nats-server authorization block for their public
// keys. It refuses to overwrite existing files unless force (which
// replaces every key of dir, the group keys not in groups too, on the
// subject prefix dir records unless s names one); on a
// directory of keys, it adds the keys of groups it lacks and keeps the
// others (ErrExists when none is missing). It returns the identities whose
// seeds it wrote.
func Init(dir string, s messages.Subjects, groups []string, force bool) ([]Identity, error) {
	ids := Identities(groups)
	for _, id := range ids {
		if _, err := For(s, id); err != nil {
			return nil, err
		}
	}
	if existing, _, err := Keys(dir); err == nil {
		if !force {
			return addKeys(dir, s, existing, ids)
		}
		// Every key is replaced, the groups' not named too: one kept
		// would be left out of ConfigFile, and written back into it
		// with its old seed by the next rotation. Without a prefix
		// named, on the prefix DIR was written for, as a rotation.
		if s.Prefix == "" {
			if s, err = dirSubjects(dir, s); err != nil {
				return nil, err
			}
		}
		for _, id := range existing {
			if !slices.ContainsFunc(ids, func(i Identity) bool { return i.Name() == id.Name() }) {
				ids = append(ids, id)
			}
		}
	}
	if !force {
		for _, name := range append(seedFiles(ids), ConfigFile) {
			if _, err := os.Stat(filepath.Join(dir, name)); err == nil {
				return nil, fmt.Errorf("%w: %s already exists; rotate keys with --force (every role then needs its new seed)", ErrExists, filepath.Join(dir, name))
			} else if !errors.Is(err, fs.ErrNotExist) {
				return nil, err
			}
		}
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	prefix := cmp.Or(s.Prefix, messages.DefaultPrefix)
	files, err := keyFiles(dir, s, ids, func(Identity) bool { return true })
	if err != nil {
		return nil, err
	}
	files = append([]file{{filepath.Join(dir, PrefixFile), []byte(prefix + "\n"), 0o644}}, files...)
	if files, err = withClusterPassword(dir, files); err != nil {
		return nil, err
	}
	return ids, commit(files)
}

// addKeys writes the seeds of the identities in want that dir lacks (a
// group's worker key, say) and rewrites ConfigFile with every key.
func addKeys(dir string, s messages.Subjects, existing, want []Identity) ([]Identity, error) {
	s, err := dirSubjects(dir, s)
	if err != nil {
		return nil, err
	}
	have := map[string]bool{}
	for _, id := range existing {
		have[id.Name()] = true
	}
	var added []Identity
	for _, id := range want {
		if !have[id.Name()] {
			added = append(added, id)
		}
	}
	files, err := withClusterPassword(dir, nil)
	if err != nil {
		return nil, err
	}
	if len(added) == 0 {
		if len(files) > 0 { // a directory written before the cluster password was
			return nil, commit(files)
		}
		return nil, fmt.Errorf("%w: every key asked for is in %s already; rotate one with --rotate NAME, or all with --force (every role then needs its new seed)", ErrExists, dir)
	}
	keys, err := keyFiles(dir, s, append(existing, added...), func(id Identity) bool { return !have[id.Name()] })
	if err != nil {
		return nil, err
	}
	return added, commit(append(files, keys...))
}

// dirSubjects returns the subjects dir's keys were written for: its
// recorded prefix, unless s names another (an error: the permissions
// would move to other subjects). An empty s.Prefix takes the recorded one;
// a directory without a record (written before it was kept) takes s.
func dirSubjects(dir string, s messages.Subjects) (messages.Subjects, error) {
	data, err := os.ReadFile(filepath.Join(dir, PrefixFile))
	if errors.Is(err, fs.ErrNotExist) {
		return s, nil
	}
	if err != nil {
		return s, err
	}
	stored := strings.TrimSpace(string(data))
	// Every permission is written under it: "*" or "a.>" would grant every
	// role the subjects of other prefixes.
	if err := messages.ValidateToken("subject prefix", stored); err != nil {
		return s, fmt.Errorf("%w: %s: %v (write the prefix its keys were made for)", ErrConfig, filepath.Join(dir, PrefixFile), err)
	}
	if s.Prefix != "" && s.Prefix != stored {
		return s, fmt.Errorf("%w: the keys in %s are for subject prefix %q, not %q; give --subject-prefix %s (or none)", ErrConfig, dir, stored, s.Prefix, stored)
	}
	return messages.Subjects{Prefix: stored}, nil
}

// Rotate gives one identity of dir (its Name: "worker", "worker-g0", ...)
// a new key and rewrites ConfigFile; the other keys stay. NATS must then
// reload the configuration and that role restart with its new seed.
func Rotate(dir string, s messages.Subjects, name string) error {
	if name == ClusterPasswordFile {
		pw, err := clusterPassword(dir)
		if err != nil {
			return err
		}
		return commit([]file{pw})
	}
	ids, _, err := Keys(dir)
	if err != nil {
		return err
	}
	if s, err = dirSubjects(dir, s); err != nil {
		return err
	}
	if !slices.ContainsFunc(ids, func(id Identity) bool { return id.Name() == name }) {
		return fmt.Errorf("%w: no key %s.nk in %s", ErrConfig, name, dir)
	}
	files, err := keyFiles(dir, s, ids, func(id Identity) bool { return id.Name() == name })
	if err != nil {
		return err
	}
	return commit(files)
}

// file is a file to write: path, content and mode.
type file struct {
	path string
	data []byte
	mode os.FileMode
}

// keyFiles returns the files that give ids their keys: a new seed for
// those renew says (the existing seed of the others is read, and must be
// valid), and ConfigFile for all of them, last. Nothing is written: every
// seed is read and every key made first, so that a bad seed file leaves
// the directory as it was.
func keyFiles(dir string, s messages.Subjects, ids []Identity, renew func(Identity) bool) ([]file, error) {
	var files []file
	var users []user
	for _, id := range ids {
		path := filepath.Join(dir, id.Name()+".nk")
		var kp nkeys.KeyPair
		var err error
		if renew(id) {
			kp, err = nkeys.CreateUser()
		} else {
			var seed []byte
			if seed, err = os.ReadFile(path); err == nil {
				kp, err = nkeys.FromSeed(bytes.TrimSpace(seed))
			}
		}
		if err != nil {
			return nil, fmt.Errorf("auth: key %s: %w (nothing was written: move the file out, or replace every key with --force)", path, err)
		}
		pub, err := kp.PublicKey()
		if err != nil {
			return nil, err
		}
		if renew(id) {
			seed, err := kp.Seed()
			if err != nil {
				return nil, err
			}
			files = append(files, file{path, append(seed, '\n'), 0o600})
		}
		perms, err := For(s, id)
		if err != nil {
			return nil, err
		}
		users = append(users, user{id: id, nkey: pub, perms: perms})
	}
	return append(files, file{filepath.Join(dir, ConfigFile), []byte(configText(users)), 0o644}), nil
}

// withClusterPassword appends a new ClusterPasswordFile to files when dir
// has none.
func withClusterPassword(dir string, files []file) ([]file, error) {
	if _, err := os.Stat(filepath.Join(dir, ClusterPasswordFile)); err == nil {
		return files, nil
	} else if !errors.Is(err, fs.ErrNotExist) {
		return nil, err
	}
	pw, err := clusterPassword(dir)
	if err != nil {
		return nil, err
	}
	return append(files, pw), nil
}

// clusterPassword is a new random ClusterPasswordFile for dir.
func clusterPassword(dir string) (file, error) {
	b := make([]byte, 32)
	if _, err := rand.Read(b); err != nil {
		return file{}, err
	}
	return file{filepath.Join(dir, ClusterPasswordFile), []byte(base64.RawURLEncoding.EncodeToString(b) + "\n"), 0o600}, nil
}

// commit writes files: each to a temporary name first, and only when all
// are written does it rename them into place, in order (ConfigFile, which
// names the seeds' keys, last). A failure before the renames leaves every
// file as it was.
func commit(files []file) error {
	for _, f := range files {
		if fi, err := os.Lstat(f.path); err == nil && !fi.Mode().IsRegular() {
			return fmt.Errorf("auth: %s is not a regular file; nothing was written", f.path)
		}
	}
	var tmps []string
	defer func() {
		for _, tmp := range tmps {
			_ = os.Remove(tmp) // gone once renamed
		}
	}()
	for _, f := range files {
		tmp := f.path + ".tmp"
		tmps = append(tmps, tmp)
		if err := writeTemp(tmp, f.data, f.mode); err != nil {
			return fmt.Errorf("auth: %w; nothing was written", err)
		}
	}
	for i, f := range files {
		if filepath.Base(f.path) == ConfigFile {
			if _, err := os.Stat(f.path); err == nil {
				// Rewritten in place: a container that mounts this one file
				// (compose's NATS) keeps the inode it started with, and a
				// renamed file would never reach its reload (SIGHUP).
				if err := writeTemp(f.path, f.data, f.mode); err != nil {
					return fmt.Errorf("auth: %w", err)
				}
				continue
			}
		}
		if err := os.Rename(tmps[i], f.path); err != nil {
			return fmt.Errorf("auth: %w", err)
		}
	}
	return nil
}

func seedFiles(ids []Identity) []string {
	out := make([]string, len(ids))
	for i, id := range ids {
		out[i] = id.Name() + ".nk"
	}
	return out
}

// writeTemp writes data to tmp at mode, synced.
func writeTemp(tmp string, data []byte, mode os.FileMode) error {
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, mode)
	if err != nil {
		return err
	}
	_, err = f.Write(data)
	if err == nil {
		err = f.Chmod(mode) // the umask does not widen or narrow it
	}
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

type user struct {
	id    Identity
	nkey  string
	perms Permissions
}

// responseWindow is how long a role may answer a request it received:
// above the longest answer kvbus makes, a hand-off target's, which may take
// 9/10 of its --shutdown-timeout (with 1m, a target given more than 66 s
// would have had its answer refused).
const responseWindow = "10m"

// configText renders the authorization block of nats-server's
// configuration format.
func configText(users []user) string {
	var b strings.Builder
	b.WriteString("# kvbus roles on the bus: written by `kvbus auth init`; load with `kvbus nats --auth-config`.\n")
	b.WriteString("# Each role may publish and subscribe only where listed; everything else is denied.\n")
	b.WriteString("authorization {\n  users = [\n")
	for _, u := range users {
		fmt.Fprintf(&b, "    # %s\n    {\n      nkey: %s\n      permissions: {\n", u.id.Name(), u.nkey)
		if len(u.perms.Publish) == 0 {
			// nats-server reads an empty allow list as no restriction.
			b.WriteString("        publish: { deny: [\">\"] }\n")
		} else {
			fmt.Fprintf(&b, "        publish: { allow: %s }\n", list(u.perms.Publish))
		}
		fmt.Fprintf(&b, "        subscribe: { allow: %s }\n", list(u.perms.Subscribe))
		if u.perms.Responses > 0 {
			fmt.Fprintf(&b, "        allow_responses: { max: %d, expires: %q }\n", u.perms.Responses, responseWindow)
		}
		b.WriteString("      }\n    }\n")
	}
	b.WriteString("  ]\n}\n")
	return b.String()
}

func list(subjects []string) string {
	q := make([]string, len(subjects))
	for i, s := range subjects {
		q[i] = strconv.Quote(s)
	}
	return "[" + strings.Join(q, ", ") + "]"
}

// Keys lists the identities whose seeds are in dir, and the stray *.nk
// files it skipped: names that are no kvbus identity (a role, or
// worker-<group>), such as a renamed old key. A stray seed is never given
// permissions: "admin-old.nk" was read as an admin key before.
func Keys(dir string) (ids []Identity, stray []string, err error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, nil, err
	}
	for _, e := range entries {
		name, ok := strings.CutSuffix(e.Name(), ".nk")
		if !ok || e.IsDir() {
			continue
		}
		id, ok := identityNamed(name)
		if !ok {
			stray = append(stray, e.Name())
			continue
		}
		ids = append(ids, id)
	}
	if len(ids) == 0 {
		return nil, stray, fmt.Errorf("%w: no *.nk seeds in %s: write them with `kvbus auth init %s`", ErrConfig, dir, dir)
	}
	return ids, stray, nil
}

// identityNamed returns the identity whose seed file is name.nk: a role,
// or worker-<group> with a valid group.
func identityNamed(name string) (Identity, bool) {
	if slices.Contains(Roles(), name) {
		return Identity{Role: name}, true
	}
	group, ok := strings.CutPrefix(name, RoleWorker+"-")
	if !ok || messages.ValidateGroup(group) != nil {
		return Identity{}, false
	}
	return Identity{Role: RoleWorker, Group: group}, true
}

// Matrix renders who may do what: one block per identity of dir.
func Matrix(dir string, s messages.Subjects) (string, error) {
	ids, _, err := Keys(dir)
	if err != nil {
		return "", err
	}
	if s, err = dirSubjects(dir, s); err != nil {
		return "", err
	}
	var b strings.Builder
	for _, id := range ids {
		p, err := For(s, id)
		if err != nil {
			return "", err
		}
		pub := strings.Join(p.Publish, " ")
		if pub == "" {
			pub = "nothing"
		}
		fmt.Fprintf(&b, "%s (%s.nk)\n  publish:   %s\n  subscribe: %s\n", id.Name(), id.Name(), pub, strings.Join(p.Subscribe, " "))
		if p.Responses > 0 {
			b.WriteString("  replies:   to the requests it receives\n")
		}
	}
	b.WriteString("everything else is denied\n")
	return b.String(), nil
}
