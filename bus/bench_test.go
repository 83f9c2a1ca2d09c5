package bus_test

import (
	"bytes"
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// The limits of the bus on this machine, which the capacity estimate in the
// README starts from: `go test ./bus -run XXX -bench . -benchtime 200000x`.

func connect(b *testing.B, url string) *nats.Conn {
	b.Helper()
	nc, err := nats.Connect(url)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(nc.Close)
	return nc
}

// benchFanOut publishes b.N 256-byte messages that subs subscribers each
// receive (1: a Request's path; 4: a ReqMeta reaching a group's ranks), and
// reports messages published and delivered per second.
func benchFanOut(b *testing.B, subs int) {
	srv := startServer(b, "")
	data := bytes.Repeat([]byte{'x'}, 256)
	var got atomic.Int64
	done := make(chan struct{})
	want := int64(b.N * subs)
	for range subs {
		nc := connect(b, srv.ClientURL())
		if _, err := nc.Subscribe("bench.fanout", func(*nats.Msg) {
			if got.Add(1) == want {
				close(done)
			}
		}); err != nil {
			b.Fatal(err)
		}
		if err := nc.Flush(); err != nil {
			b.Fatal(err)
		}
	}
	pub := connect(b, srv.ClientURL())
	b.SetBytes(int64(len(data)))
	b.ResetTimer()
	start := time.Now()
	for range b.N {
		if err := pub.Publish("bench.fanout", data); err != nil {
			b.Fatal(err)
		}
	}
	select {
	case <-done:
	case <-time.After(time.Minute):
		b.Fatalf("%d of %d deliveries after a minute (slow consumers drop messages)", got.Load(), want)
	}
	s := time.Since(start).Seconds()
	b.ReportMetric(float64(b.N)/s, "published/s")
	b.ReportMetric(float64(want)/s, "delivered/s")
}

func BenchmarkCorePubSub256B(b *testing.B)        { benchFanOut(b, 1) }
func BenchmarkCoreFanOut4x256B(b *testing.B)      { benchFanOut(b, 4) }
func BenchmarkJetStreamPublishAsync(b *testing.B) { benchJetStream(b, true) }
func BenchmarkJetStreamPublishSync(b *testing.B)  { benchJetStream(b, false) }

// benchJetStream publishes b.N 300-byte messages (a Request's size) to a
// file-backed stream, each with a Nats-Msg-Id as the frontend sends them,
// acknowledged by the server: sync waits for each ack (one frontend
// request), async keeps up to 4096 in flight (many at once).
func benchJetStream(b *testing.B, async bool) {
	srv := startServer(b, "")
	js, err := jetstream.New(connect(b, srv.ClientURL()), jetstream.WithPublishAsyncMaxPending(4096))
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "BENCH", Subjects: []string{"bench.js"}, Storage: jetstream.FileStorage}); err != nil {
		b.Fatal(err)
	}
	data := bytes.Repeat([]byte{'x'}, 300)
	ids := make([]string, b.N)
	for i := range ids {
		ids[i] = nats.NewInbox()
	}
	b.SetBytes(int64(len(data)))
	b.ResetTimer()
	start := time.Now()
	for i := range b.N {
		msg := &nats.Msg{Subject: "bench.js", Data: data, Header: nats.Header{}}
		if async {
			if _, err := js.PublishMsgAsync(msg, jetstream.WithMsgID(ids[i])); err != nil {
				b.Fatal(err)
			}
			continue
		}
		if _, err := js.PublishMsg(ctx, msg, jetstream.WithMsgID(ids[i])); err != nil {
			b.Fatal(err)
		}
	}
	if async {
		select {
		case <-js.PublishAsyncComplete():
		case <-time.After(time.Minute):
			b.Fatal("async publishes not acknowledged after a minute")
		}
	}
	b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "msgs/s")
}
