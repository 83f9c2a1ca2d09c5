package top

import (
	"fmt"
	"sort"
	"strings"
	"time"

	tea "charm.land/bubbletea/v2"
	"charm.land/lipgloss/v2"
)

// groupOrders are the group orders of the view, cycled with "s".
func groupOrders() [numGroupOrders]string {
	return [numGroupOrders]string{"name", "queue", "inflight", "blocks"}
}

const numGroupOrders = 4

// Model is `kvbus top`'s terminal view of a Watcher, redrawn every
// Refresh. Keys: q quits; s cycles the group order (name, queue, in-flight,
// blocks); / filters the sessions by id (enter keeps the filter, esc clears
// it).
type Model struct {
	w        *Watcher
	refresh  time.Duration
	snap     Snapshot
	order    int
	filter   string
	typing   bool
	sessions int
	width    int
}

// NewModel returns the view of w, redrawn every refresh (at most 1 s; 0
// or less: 1 s), listing up to sessions sessions (0 or less: none).
func NewModel(w *Watcher, refresh time.Duration, sessions int) Model {
	if refresh <= 0 || refresh > time.Second {
		refresh = time.Second
	}
	sessions = max(sessions, 0)
	return Model{w: w, refresh: refresh, sessions: sessions, snap: w.Snapshot(time.Now())}
}

type tickMsg time.Time

func (m Model) tick() tea.Cmd {
	return tea.Tick(m.refresh, func(t time.Time) tea.Msg { return tickMsg(t) })
}

// Init implements tea.Model.
func (m Model) Init() tea.Cmd { return m.tick() }

// Update implements tea.Model.
func (m Model) Update(msg tea.Msg) (tea.Model, tea.Cmd) {
	switch msg := msg.(type) {
	case tickMsg:
		m.snap = m.w.Snapshot(time.Time(msg))
		return m, m.tick()
	case tea.WindowSizeMsg:
		m.width = msg.Width
	case tea.KeyPressMsg:
		k := msg.String()
		if m.typing {
			switch k {
			case "enter":
				m.typing = false
			case "esc":
				m.typing, m.filter = false, ""
			case "backspace":
				if m.filter != "" {
					m.filter = m.filter[:len(m.filter)-1]
				}
			default:
				if t := msg.Key().Text; t != "" {
					m.filter += t
				}
			}
			return m, nil
		}
		switch k {
		case "q", "ctrl+c":
			return m, tea.Quit
		case "s":
			m.order = (m.order + 1) % numGroupOrders
		case "/":
			m.typing, m.filter = true, ""
		case "esc":
			m.filter = ""
		}
	}
	return m, nil
}

// View implements tea.Model.
func (m Model) View() tea.View {
	v := tea.NewView(m.Render())
	v.AltScreen = true
	v.WindowTitle = "kvbus top"
	return v
}

// Render draws the snapshot as text (View's content).
func (m Model) Render() string {
	titleStyle := lipgloss.NewStyle().Bold(true)
	headStyle := lipgloss.NewStyle().Bold(true).Underline(true)
	dimStyle := lipgloss.NewStyle().Faint(true)
	s := m.snap
	var b strings.Builder
	fmt.Fprintf(&b, "%s  %s   %.1f req/s   TTFT p50 %.0f ms  p95 %.0f ms   in flight %d   failed %d   aborted %d (last %.0fs)\n",
		titleStyle.Render("kvbus top"), s.At.Format("15:04:05"), s.RequestsPerSec, s.TTFTP50Ms, s.TTFTP95Ms, s.InFlight, s.Failed, s.Aborted, s.WindowSec)
	b.WriteString("hit ratio by turn:")
	for _, l := range []string{"1", "2", "3", "4+"} {
		if r, ok := s.HitRatio[l]; ok {
			fmt.Fprintf(&b, "  %s: %.2f", l, r)
		} else {
			fmt.Fprintf(&b, "  %s: -", l)
		}
	}
	b.WriteString("\n")
	for _, sc := range s.Schedulers {
		state := "ready"
		if !sc.Ready {
			state = "not ready: " + sc.Reason
		}
		fmt.Fprintf(&b, "scheduler %s %s (%d groups)\n", sc.ID, state, sc.ReadyGroups)
	}
	groups := append([]GroupRow(nil), s.Groups...)
	order := groupOrders()[m.order]
	sort.SliceStable(groups, func(i, j int) bool {
		a, c := groups[i], groups[j]
		switch order {
		case "queue":
			return a.QueuedPrefillTokens+a.QueuedLoadTokens > c.QueuedPrefillTokens+c.QueuedLoadTokens
		case "inflight":
			return a.Inflight > c.Inflight
		case "blocks":
			return a.Blocks > c.Blocks
		}
		return a.Name < c.Name
	})
	fmt.Fprintf(&b, "\n%s\n", headStyle.Render(fmt.Sprintf("%-8s %-10s %6s %9s %12s %10s %12s %9s %9s %9s", "GROUP", "STATE", "RANKS", "INFLIGHT",
		"QUEUED_TOK", "LOAD_TOK", "BLOCKS", "BYTES", "POOL_IN", "POOL_OUT")))
	for _, g := range groups {
		fmt.Fprintf(&b, "%-8s %-10s %3d/%-2d %9d %12d %10d %12d %9s %9d %9d\n", g.Name, g.State, g.Ranks, g.WorldSize, g.Inflight,
			g.QueuedPrefillTokens, g.QueuedLoadTokens, g.Blocks, bytesString(g.Bytes), g.PoolIn, g.PoolOut)
	}
	if len(groups) == 0 {
		b.WriteString(dimStyle.Render("no worker group heard yet") + "\n")
	}
	fmt.Fprintf(&b, "\n%s\n", headStyle.Render(fmt.Sprintf("%-36s %-8s %6s %8s %9s", "SESSION", "GROUP", "TURNS", "RECENT", "HIT")))
	shown := 0
	for _, ss := range s.Sessions {
		if m.filter != "" && !strings.Contains(ss.ID, m.filter) {
			continue
		}
		if shown == m.sessions {
			break
		}
		shown++
		fmt.Fprintf(&b, "%-36s %-8s %6d %8d %9.2f\n", truncate(ss.ID, 36), ss.Group, ss.Turns, ss.Recent, ss.HitRatio)
	}
	help := fmt.Sprintf("q quit  s sort groups (%s)  / filter sessions", order)
	switch {
	case m.typing:
		help = "filter: " + m.filter + "_  (enter keep, esc clear)"
	case m.filter != "":
		help += fmt.Sprintf("  [filter %q, esc clears]", m.filter)
	}
	b.WriteString("\n" + dimStyle.Render(help) + "\n")
	return b.String()
}

// bytesString is n in B, KiB, MiB, GiB or TiB.
func bytesString(n int64) string {
	v, units := float64(n), []string{"B", "KiB", "MiB", "GiB", "TiB"}
	i := 0
	for v >= 1024 && i < len(units)-1 {
		v /= 1024
		i++
	}
	if i == 0 {
		return fmt.Sprintf("%d B", n)
	}
	return fmt.Sprintf("%.1f %s", v, units[i])
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n-1] + "…"
}
