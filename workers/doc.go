// Package workers implements the ranks of a worker group: each TP/EP rank is
// its own "Mooncake store" worker with a block store, a load thread and a
// store thread; the driver rank (tp_rank 0) also runs the engine that
// produces output tokens. The sim engine stands in for a GPU model.
package workers
