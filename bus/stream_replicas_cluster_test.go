package bus_test

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvbus/kvbus/bus"
	"github.com/kvbus/kvbus/messages"
	"github.com/kvbus/kvbus/testenv"
)

// TestOneReplicaOnAClusterIsWarnedAbout: a role that makes (or finds) the
// request log with one replica on a clustered NATS says so at start, naming
// --stream-replicas: the log then lives on one server, and while that
// server is down every request fails. With replicas on every server, or on
// a server that is not clustered, it says nothing. Before, the default
// --stream-replicas 1 on a 3-node cluster made a log of one replica
// without a word (a kill -9 of the server holding it: every request 503
// after 10 s until it came back, /health 200 throughout).
func TestOneReplicaOnAClusterIsWarnedAbout(t *testing.T) {
	cl := testenv.FreeAddrs(t, 3)
	var srvs []*bus.Server
	for i, name := range []string{"r1", "r2", "r3"} {
		var routes []string
		for j := range cl {
			if j != i {
				routes = append(routes, "nats://"+cl[j])
			}
		}
		srvs = append(srvs, startCfg(t, bus.ServerConfig{ServerName: name, Cluster: cl[i], ClusterName: "kvbus", Routes: routes}))
	}
	nc := connectTo(t, srvs[0].ClientURL())
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	var streams = map[string]jetstream.Stream{}
	ensure := func(prefix string, replicas int) string {
		t.Helper()
		log, buf := captureLogger(slog.LevelInfo)
		ctx, cancel := context.WithTimeout(bus.WithLogger(t.Context(), log), 60*time.Second)
		defer cancel()
		st, err := bus.EnsureRequestStream(ctx, js, bus.StreamConfig{Subjects: messages.Subjects{Prefix: prefix}, Replicas: replicas})
		if err != nil {
			t.Fatalf("request log of %s, %d replicas: %v", prefix, replicas, err)
		}
		streams[prefix] = st
		return buf.String()
	}
	consumer := func(st jetstream.Stream, replicas int) string {
		t.Helper()
		log, buf := captureLogger(slog.LevelInfo)
		ctx, cancel := context.WithTimeout(bus.WithLogger(t.Context(), log), 60*time.Second)
		defer cancel()
		if _, err := bus.EnsureSchedulerConsumer(ctx, st, 0, replicas); err != nil {
			t.Fatalf("consumer, %d replicas: %v", replicas, err)
		}
		return buf.String()
	}
	if logs := ensure("one", 1); !strings.Contains(logs, "one replica") || !strings.Contains(logs, "--stream-replicas") {
		t.Errorf("request log of one replica made on a 3-server cluster, nothing said about it:\n%s", logs)
	}
	if logs := ensure("one", 1); !strings.Contains(logs, "one replica") {
		t.Errorf("request log of one replica found on a 3-server cluster, nothing said about it:\n%s", logs)
	}
	if logs := ensure("three", 3); strings.Contains(logs, "one replica") {
		t.Errorf("request log of 3 replicas warned about:\n%s", logs)
	}
	// A scheduler with --stream-replicas 1 on a log of 3: its consumer is
	// on one server.
	if logs := consumer(streams["three"], 1); !strings.Contains(logs, "consumer of the request log has one replica") || !strings.Contains(logs, "--stream-replicas") {
		t.Errorf("consumer of one replica on a 3-server cluster, nothing said about it:\n%s", logs)
	}
	if logs := ensure("three2", 3); strings.Contains(logs, "one replica") {
		t.Errorf("request log of 3 replicas warned about:\n%s", logs)
	}
	if logs := consumer(streams["three2"], 3); strings.Contains(logs, "one replica") {
		t.Errorf("consumer of 3 replicas warned about:\n%s", logs)
	}
	// One server, not clustered: one replica is all it can hold.
	single := newJS(t)
	log, buf := captureLogger(slog.LevelInfo)
	st, err := bus.EnsureRequestStream(bus.WithLogger(t.Context(), log), single, bus.StreamConfig{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := bus.EnsureSchedulerConsumer(bus.WithLogger(t.Context(), log), st, 0, 1); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(buf.String(), "one replica") {
		t.Errorf("request log or consumer on a lone server warned about:\n%s", buf)
	}
}
