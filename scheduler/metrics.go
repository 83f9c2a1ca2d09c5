package scheduler

import "github.com/prometheus/client_golang/prometheus"

type metrics struct {
	routing       prometheus.Histogram
	requests      *prometheus.CounterVec
	ready         prometheus.Gauge
	modelReady    *prometheus.GaugeVec
	predicted     prometheus.Counter
	actual        prometheus.Counter
	promptTokens  *prometheus.CounterVec
	cachedTokens  *prometheus.CounterVec
	groupInflight *prometheus.GaugeVec
	groupQueued   *prometheus.GaugeVec
	groupBlocks   *prometheus.GaugeVec
	indexEntries  prometheus.Gauge
	indexBlocks   prometheus.Gauge
	resyncs       prometheus.Counter
	resends       prometheus.Counter
	frontendsGone prometheus.Counter
	poolTokens    *prometheus.CounterVec
	// The request log, as this replica last read it (every logCheckEvery).
	logPending prometheus.Gauge
	logBytes   prometheus.Gauge
	logLimit   prometheus.Gauge
	// Heartbeats: how far apart a rank's arrive, and the timeout they
	// are judged by.
	heartbeatGap     prometheus.Histogram
	heartbeatTimeout prometheus.Gauge
}

// metricFuncs read the values of the metrics kept elsewhere; each is
// called at every scrape, concurrently with the scheduler.
type metricFuncs struct {
	trackers, rejected, refused, plans, ready, sessions, unbound func() float64
}

func newMetrics(reg prometheus.Registerer, f metricFuncs) *metrics {
	m := &metrics{
		routing: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "kvbus_scheduler_routing_seconds",
			Help:    "Time from a Request received to its ReqMeta published (decode, hashing, index lookup, placement, encode).",
			Buckets: prometheus.ExponentialBuckets(5e-6, 2, 16),
		}),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvbus_scheduler_requests_total",
			Help: "Requests by outcome: dispatched, redispatched (moved off a failed group), adopted (dispatched by a replica that died; this one watches it now), completed, failed (an error of its group or engine, or the group failed while generating), timeout (its deadline passed: at the ranks, at the frontend, or unanswered here), aborted (its client went away, its frontend stopped, or its frontend was found gone: kvbus_scheduler_frontends_gone_total), withdrawn (its frontend gave it up for a copy it published again, or its publish failed), duplicate, expired, no_ready_group (refused: no group ready within --no-group-wait), too_large (its ReqMeta above the server's max_payload).",
		}, []string{"outcome"}),
		ready: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvbus_scheduler_ready_groups",
			Help: "Worker groups that take requests: every rank sent a heartbeat within --heartbeat-timeout, none drains or fails its engine's health check.",
		}),
		modelReady: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "kvbus_scheduler_model_ready_groups",
			Help: "Ready worker groups by the model their ranks serve (a request is placed only on a group of its model); a model whose groups all stopped is 0 until they are forgotten.",
		}, []string{"model"}),
		predicted: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvbus_scheduler_predicted_cached_tokens_total",
			Help: "Prompt tokens the LoadSpecs told ranks to load (the prediction), over completed requests whose LoadSpec this replica made (not one taken over from another replica: its ranks ran that replica's).",
		}),
		actual: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvbus_scheduler_actual_cached_tokens_total",
			Help: "Prompt tokens every rank of the group actually loaded (the least of its ranks': a block one rank missed is prefilled by the group), over the completed requests of kvbus_scheduler_predicted_cached_tokens_total.",
		}),
		promptTokens: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvbus_scheduler_prompt_tokens_total",
			Help: "Prompt tokens of completed requests by model and the session's turn depth (1, 2, 3, 4+).",
		}, []string{"model", "turn_depth"}),
		cachedTokens: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvbus_scheduler_cached_tokens_total",
			Help: "Prompt tokens loaded from the KV store by model and turn depth; divide by kvbus_scheduler_prompt_tokens_total for the hit ratio.",
		}, []string{"model", "turn_depth"}),
		groupInflight: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "kvbus_scheduler_group_inflight_requests",
			Help: "Requests in flight on a group, cluster-wide as this replica sees it (the driver rank's last heartbeat plus what this replica dispatched and heard finish since): every replica reports about the same value, so take max by group, never sum over replicas. model is the model the group's driver rank serves.",
		}, []string{"group", "model"}),
		groupQueued: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "kvbus_scheduler_group_queue_blocks",
			Help: "Blocks to prefill of the in-flight requests on a group (the load term of the kv policy).",
		}, []string{"group", "model"}),
		groupBlocks: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "kvbus_scheduler_group_blocks",
			Help: "KV blocks every rank of a group holds, per the index.",
		}, []string{"group", "model"}),
		indexEntries: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvbus_scheduler_index_entries",
			Help: "(group, block) entries in the KV index: a block some rank of the group holds (kvbus_scheduler_group_blocks counts those every rank holds, which a load needs).",
		}),
		indexBlocks: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvbus_scheduler_index_blocks",
			Help: "Distinct blocks held in full by at least one group.",
		}),
		resyncs: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvbus_scheduler_kv_resyncs_total",
			Help: "Dumps requested from ranks after a gap in their KV events or a restart.",
		}),
		poolTokens: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvbus_scheduler_pool_cached_tokens_total",
			Help: "Cached prompt tokens of completed requests whose LoadSpec this replica made, predicted by the LoadSpec and actually loaded by every rank of the group, by where they were read (local: the group's own segments; remote: other groups').",
		}, []string{"kind", "source"}),
		resends: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvbus_scheduler_reqmeta_resends_total",
			Help: "ReqMetas published again because a rank of the group had not answered (receipt or result) within --resend-after.",
		}),
		logPending: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvbus_scheduler_request_log_pending_messages",
			Help: "Requests in the request log no scheduler has taken yet (the schedulers' consumer's pending count, read every 2 s).",
		}),
		logBytes: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvbus_scheduler_request_log_bytes",
			Help: "Bytes the request log holds (undispatched requests and the dispatched history kept for capture), read every 2 s.",
		}),
		logLimit: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvbus_scheduler_request_log_limit_bytes",
			Help: "The request log's size limit (--request-log-max-bytes when it was created): at it new requests get 503 request_log_full.",
		}),
		heartbeatGap: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "kvbus_scheduler_heartbeat_gap_seconds",
			Help:    "Time between two heartbeats of one rank's process as this replica handled them (a rank sends one every --heartbeat-interval, 1 s, and a driver one per request too). Gaps near kvbus_scheduler_heartbeat_timeout_seconds mean starved workers or a congested bus: their groups are about to be judged failed.",
			Buckets: []float64{0.05, 0.25, 0.5, 1, 1.1, 1.25, 1.5, 2, 2.5, 3, 5, 10},
		}),
		frontendsGone: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvbus_scheduler_frontends_gone_total",
			Help: "Frontends found gone with requests of this replica in flight (nobody heard on their output subject for --frontend-gone-after: killed, or cut off): their requests were aborted on their groups.",
		}),
		heartbeatTimeout: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvbus_scheduler_heartbeat_timeout_seconds",
			Help: "--heartbeat-timeout: a group with a rank not heard from for this long takes no request, and its requests move (or fail).",
		}),
	}
	if reg != nil {
		reg.MustRegister(m.heartbeatGap, m.heartbeatTimeout, m.routing, m.requests, m.ready, m.predicted, m.actual, m.promptTokens, m.cachedTokens,
			m.modelReady, m.groupInflight, m.groupQueued, m.groupBlocks, m.indexEntries, m.indexBlocks, m.resyncs,
			m.resends, m.frontendsGone, m.poolTokens, m.logPending, m.logBytes, m.logLimit,
			prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvbus_scheduler_trackers", Help: "Live RequestTrackers."}, f.trackers),
			prometheus.NewGaugeFunc(prometheus.GaugeOpts{
				Name: "kvbus_scheduler_ready",
				Help: "1 while the replica is ready (what its /healthz and its announcements say): it consumes the request log and a ready worker group's KV index is synced.",
			}, f.ready),
			prometheus.NewCounterFunc(prometheus.CounterOpts{
				Name: "kvbus_scheduler_kv_batches_rejected_total",
				Help: "KV event batches dropped as malformed: a seq impossibly far past the rank's last known seq (corrupted, replayed or forged).",
			}, f.rejected),
			prometheus.NewCounterFunc(prometheus.CounterOpts{
				Name: "kvbus_scheduler_index_stores_refused_total",
				Help: "Blocks ranks said they stored that the KV index did not record: the rank already held its bound (twice the capacity_blocks of its heartbeats plus one request's blocks, at most 4,194,304; that many when it says none) or the index held 134,217,728 (group, block) entries. A forged rank, or a rank whose capacity grew without a restart: the scheduler logs which.",
			}, f.refused),
			prometheus.NewGaugeFunc(prometheus.GaugeOpts{
				Name: "kvbus_scheduler_save_plans",
				Help: "(group, block) save plans of dispatched requests not yet confirmed by the ranks' KV events.",
			}, f.plans),
			prometheus.NewGaugeFunc(prometheus.GaugeOpts{
				Name: "kvbus_scheduler_sessions",
				Help: "Sessions the replica knows bound to a group (the session bucket's live keys): about --max-sessions at most (replicas binding new sessions at once may each add some before they hear the others').",
			}, f.sessions),
			prometheus.NewCounterFunc(prometheus.CounterOpts{
				Name: "kvbus_scheduler_sessions_unbound_total",
				Help: "Turns of new sessions left unbound because --max-sessions sessions were bound: placed by their prompt alone.",
			}, f.unbound))
	}
	return m
}
