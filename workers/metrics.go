package workers

import "github.com/prometheus/client_golang/prometheus"

// Metrics are the worker ranks' Prometheus metrics. One Metrics serves every
// rank of a process; series are labelled by group and tp_rank.
type Metrics struct {
	reqMetas  *prometheus.CounterVec
	dropped   *prometheus.CounterVec
	blocks    *prometheus.CounterVec
	loadSec   *prometheus.HistogramVec
	storeSec  *prometheus.HistogramVec
	usedBytes *prometheus.GaugeVec
	capBytes  *prometheus.GaugeVec
	evictIdle *prometheus.HistogramVec
	queue     *prometheus.GaugeVec
	// Pool reads, by source group, target group and tp_rank.
	remote      *prometheus.CounterVec
	remoteBytes *prometheus.CounterVec
	remoteSec   *prometheus.HistogramVec
	// Blocks kept from a draining group, by source group, group, tp_rank.
	handoff      *prometheus.CounterVec
	handoffBytes *prometheus.CounterVec
	// Outputs of streams published again for a frontend that lost them.
	resent *prometheus.CounterVec
}

// NewMetrics registers the worker metrics with reg; a nil reg leaves them
// unregistered (still usable).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	l := []string{"group", "tp_rank"}
	m := &Metrics{
		reqMetas: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvbus_worker_reqmeta_total", Help: "ReqMeta messages received by a rank.",
		}, l),
		dropped: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvbus_worker_dropped_total", Help: "ReqMetas a rank did not run, by reason (duplicate, overloaded, aborted).",
		}, append(l, "reason")),
		blocks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvbus_worker_blocks_total", Help: "KV blocks handled by a rank, by op (loaded, load_failed, waited_for_save, pool_awaited_intake, pool_not_awaited, stored, skipped, store_failed).",
		}, append(l, "op")),
		loadSec: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "kvbus_worker_load_seconds", Help: "Time a rank's load thread spent on one request.",
			Buckets: prometheus.ExponentialBuckets(1e-6, 4, 12),
		}, l),
		storeSec: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "kvbus_worker_store_seconds", Help: "Time a rank's store thread spent on one request.",
			Buckets: prometheus.ExponentialBuckets(1e-6, 4, 12),
		}, l),
		usedBytes: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "kvbus_worker_store_used_bytes", Help: "Bytes held by a rank's block store.",
		}, l),
		capBytes: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "kvbus_worker_store_capacity_bytes", Help: "Bytes a rank's block store may hold (--kv-capacity): kvbus_worker_store_used_bytes over it is how full the store is.",
		}, l),
		evictIdle: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "kvbus_worker_store_block_idle_before_evict_seconds",
			Help:    "How long a block evicted from a rank's store to make room had gone unused (vLLM's kv_block_idle_before_evict_seconds): when it is shorter than the time between a conversation's turns, --kv-capacity is too small for them to hit.",
			Buckets: prometheus.ExponentialBucketsRange(0.01, 3600, 12),
		}, l),
		queue: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "kvbus_worker_queue_depth", Help: "Requests queued or running on a rank.",
		}, l),
		remote: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvbus_worker_pool_remote_blocks_total", Help: "Blocks a rank copied from another group's segment of the KV pool.",
		}, []string{"source_group", "group", "tp_rank"}),
		remoteBytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvbus_worker_pool_remote_bytes_total", Help: "Bytes a rank copied from another group's segment of the KV pool (with --kv-payload accounting, the sizes charged).",
		}, []string{"source_group", "group", "tp_rank"}),
		remoteSec: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "kvbus_worker_pool_remote_read_seconds", Help: "Time of one pool read of a run of blocks from another group.",
			Buckets: prometheus.ExponentialBuckets(1e-5, 4, 10),
		}, []string{"source_group", "group", "tp_rank"}),
		handoff: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvbus_worker_handoff_blocks_total", Help: "Blocks a rank kept that a draining group handed off (--drain-handoff).",
		}, []string{"source_group", "group", "tp_rank"}),
		handoffBytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvbus_worker_handoff_bytes_total", Help: "Bytes (charged block sizes) a rank kept that a draining group handed off.",
		}, []string{"source_group", "group", "tp_rank"}),
		resent: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvbus_worker_outputs_resent_total", Help: "Outputs a driver rank published again: why=asked, of a stream whose frontend lost them on the bus; why=reconnect, published just before the rank's NATS connection broke, in case its server lost them.",
		}, append(l, "why")),
	}
	if reg != nil {
		reg.MustRegister(m.reqMetas, m.dropped, m.blocks, m.loadSec, m.storeSec, m.usedBytes, m.capBytes, m.evictIdle, m.queue,
			m.remote, m.remoteBytes, m.remoteSec, m.handoff, m.handoffBytes, m.resent)
	}
	return m
}

// rankSeries are one rank's series, looked up once: a label lookup hashes
// the labels and takes a lock, and a rank touches a dozen series per
// request.
type rankSeries struct {
	reqMetas, duplicate, overloaded, aborted                        prometheus.Counter
	loaded, loadFailed, waitedForSave, stored, skipped, storeFailed prometheus.Counter
	poolAwaitedIntake, poolNotAwaited                               prometheus.Counter
	resent, republished                                             prometheus.Counter
	loadSec, storeSec, evictIdle                                    prometheus.Observer
	usedBytes, capBytes, queue                                      prometheus.Gauge
}

func (m *Metrics) forRank(group, rank string) rankSeries {
	op := func(name string) prometheus.Counter { return m.blocks.WithLabelValues(group, rank, name) }
	return rankSeries{
		reqMetas:      m.reqMetas.WithLabelValues(group, rank),
		duplicate:     m.dropped.WithLabelValues(group, rank, "duplicate"),
		overloaded:    m.dropped.WithLabelValues(group, rank, "overloaded"),
		aborted:       m.dropped.WithLabelValues(group, rank, "aborted"),
		loaded:        op("loaded"),
		loadFailed:    op("load_failed"),
		waitedForSave: op("waited_for_save"),
		// Blocks a pool read that had to wait for this rank's ReqMeta
		// intake found after waiting (see onPoolRead).
		poolAwaitedIntake: op("pool_awaited_intake"),
		// Blocks a pool read did not wait for: their save was queued
		// behind this rank's own read from the reader's group.
		poolNotAwaited: op("pool_not_awaited"),
		stored:         op("stored"),
		skipped:        op("skipped"),
		storeFailed:    op("store_failed"),
		resent:         m.resent.WithLabelValues(group, rank, "asked"),
		republished:    m.resent.WithLabelValues(group, rank, "reconnect"),
		loadSec:        m.loadSec.WithLabelValues(group, rank),
		storeSec:       m.storeSec.WithLabelValues(group, rank),
		evictIdle:      m.evictIdle.WithLabelValues(group, rank),
		usedBytes:      m.usedBytes.WithLabelValues(group, rank),
		capBytes:       m.capBytes.WithLabelValues(group, rank),
		queue:          m.queue.WithLabelValues(group, rank),
	}
}
