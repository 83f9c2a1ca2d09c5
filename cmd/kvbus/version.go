package main

import "runtime/debug"

// version is kvbus's version, set at link time: `make build` and
// `make image` pass -ldflags "-X main.version=$(git describe --always
// --dirty)". Empty in a plain go build.
var version string

// buildVersion is the version kvbus reports (kvbus --version, the
// frontend's /version): the one linked in, else the module's version of a
// `go install …@v1.2.3`, else the commit Go stamped, else "devel".
func buildVersion() string {
	if version != "" {
		return version
	}
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return "devel"
	}
	if v := bi.Main.Version; v != "" && v != "(devel)" {
		return v
	}
	for _, st := range bi.Settings {
		if st.Key == "vcs.revision" && st.Value != "" {
			return "devel+" + st.Value[:min(12, len(st.Value))]
		}
	}
	return "devel"
}
