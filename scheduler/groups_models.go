package scheduler

import "slices"

// servesModel reports whether a group serving groupModel takes a request
// for model. A group or request that names no model (a worker or client of
// a kvbus before models were told apart, a test) matches any.
func servesModel(groupModel, model string) bool {
	return groupModel == model || groupModel == "" || model == ""
}

// forModel returns the groups of groups that serve model, in their order:
// groups itself when all do (one model: no copy per request), else a new
// slice (groups is not changed).
func forModel(groups []GroupState, model string) []GroupState {
	for i, g := range groups {
		if servesModel(g.Model, model) {
			continue
		}
		out := slices.Clone(groups[:i])
		for _, g := range groups[i+1:] {
			if servesModel(g.Model, model) {
				out = append(out, g)
			}
		}
		return out
	}
	return groups
}

// servedModels lists the models groups serve, sorted, for error messages.
func servedModels(groups []GroupState) []string {
	var out []string
	for _, g := range groups {
		if g.Model != "" && !slices.Contains(out, g.Model) {
			out = append(out, g.Model)
		}
	}
	slices.Sort(out)
	return out
}
