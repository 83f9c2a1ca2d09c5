package top

import (
	"fmt"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	tea "charm.land/bubbletea/v2"
	"charm.land/lipgloss/v2"
	"github.com/charmbracelet/x/ansi"
)

// groupOrders are the group orders of the view, cycled with "s".
func groupOrders() [numGroupOrders]string {
	return [numGroupOrders]string{"name", "queue", "inflight", "blocks"}
}

const numGroupOrders = 4

// Model is `kvbus top`'s terminal view of a Watcher, redrawn every
// Refresh. Keys: q quits; s cycles the group order (name, queue, in-flight,
// blocks); / filters the sessions by id (enter keeps the filter, esc clears
// it). It fits the terminal: the header wraps, the group table drops its
// least useful columns, the sessions take the lines left.
type Model struct {
	w        *Watcher
	refresh  time.Duration
	snap     Snapshot
	order    int
	filter   string
	typing   bool
	sessions int
	width    int // 0: unbounded
	height   int // 0: unbounded
	plain    bool
	report   bool // once: no help line
}

// NewModel returns the view of w, redrawn every refresh (0 or less: 1 s),
// listing up to sessions sessions (0 or less: none).
func NewModel(w *Watcher, refresh time.Duration, sessions int) Model {
	if refresh <= 0 {
		refresh = time.Second
	}
	sessions = max(sessions, 0)
	m := Model{w: w, refresh: refresh, sessions: sessions}
	m.snap = m.snapshot(time.Now())
	return m
}

// Sized returns m drawn for a terminal of width columns and height lines
// (0: unbounded), as a tea.WindowSizeMsg does.
func (m Model) Sized(width, height int) Model {
	m.width, m.height = width, height
	return m
}

// Report is the view once, for `kvbus top --once`: no help line, and with
// plain set no styling (a pipe, NO_COLOR, TERM=dumb).
func (m Model) Report(plain bool) string {
	m.plain, m.report = plain, true
	return m.Render()
}

// At returns m showing the cluster as of now, as a redraw does.
func (m Model) At(now time.Time) Model {
	m.snap = m.snapshot(now)
	return m
}

func (m Model) snapshot(now time.Time) Snapshot {
	return m.w.SnapshotWith(now, SnapshotOptions{Sessions: m.sessions, Filter: m.filter})
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
		m.snap = m.snapshot(time.Time(msg))
		return m, m.tick()
	case tea.WindowSizeMsg:
		m.width, m.height = msg.Width, msg.Height
	case tea.KeyPressMsg:
		k := msg.String()
		if m.typing {
			switch k {
			case "enter":
				m.typing = false
			case "esc":
				m.typing, m.filter = false, ""
			case "backspace":
				if r := []rune(m.filter); len(r) > 0 {
					m.filter = string(r[:len(r)-1])
				}
			default:
				if t := msg.Key().Text; t != "" {
					m.filter += t
				}
			}
			m.snap = m.snapshot(m.snap.At)
			return m, nil
		}
		switch k {
		case "q", "ctrl+c":
			return m, tea.Quit
		case "s":
			m.order = (m.order + 1) % numGroupOrders
		case "/":
			m.typing, m.filter = true, ""
			m.snap = m.snapshot(m.snap.At)
		case "esc":
			m.filter = ""
			m.snap = m.snapshot(m.snap.At)
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

// styles are the view's; all plain when m.plain.
type styles struct{ title, head, dim, alert lipgloss.Style }

func (m Model) styles() styles {
	if m.plain {
		p := lipgloss.NewStyle()
		return styles{p, p, p, p}
	}
	return styles{
		title: lipgloss.NewStyle().Bold(true),
		head:  lipgloss.NewStyle().Bold(true).Underline(true),
		dim:   lipgloss.NewStyle().Faint(true),
		alert: lipgloss.NewStyle().Bold(true).Reverse(true),
	}
}

// Render draws the snapshot as text (View's content), fitted to the size.
func (m Model) Render() string {
	st := m.styles()
	s := m.snap
	var top []string // what comes before the sessions
	if d := s.Disconnected; d != nil {
		top = append(top, m.alert(st, fmt.Sprintf("disconnected from NATS at %s since %s, reconnecting; the rows below are stale (as last heard)",
			Printable(d.URL), d.Since.Format("15:04:05")))...)
	}
	top = append(top, m.wrap([]string{
		st.title.Render("kvbus top") + "  " + s.At.Format("15:04:05"),
		fmt.Sprintf("%.1f req/s", s.RequestsPerSec),
		fmt.Sprintf("TTFT p50 %.0f ms  p95 %.0f ms", s.TTFTP50Ms, s.TTFTP95Ms),
		fmt.Sprintf("in flight %d", s.InFlight),
		fmt.Sprintf("failed %d", s.Failed),
		fmt.Sprintf("aborted by clients %d", s.Aborted),
		fmt.Sprintf("(last %.0fs)", s.WindowSec),
	}, "   ")...)
	hit := []string{"hit ratio by turn:"}
	for _, l := range []string{"1", "2", "3", "4+"} {
		if r, ok := s.HitRatio[l]; ok {
			hit = append(hit, fmt.Sprintf("%s: %.2f", l, r))
		} else {
			hit = append(hit, l+": -")
		}
	}
	top = append(top, m.wrap(hit, "  ")...)
	if s.NoReadyScheduler {
		top = append(top, m.alert(st, "no ready scheduler: frontends answer 503 no_ready_scheduler")...)
	}
	for _, sc := range s.Schedulers {
		var state string
		switch sc.State {
		case "ready":
			state = fmt.Sprintf("ready (%d groups)", sc.ReadyGroups)
		case "silent":
			state = fmt.Sprintf("silent %ds (not ready)", sc.AgeMs/1000)
		case "stopped":
			state = "stopped"
		default:
			state = "not ready: " + Printable(sc.Reason)
		}
		top = append(top, m.wrap([]string{"scheduler " + Printable(sc.ID), state}, " ")...)
	}
	top = append(top, "")
	top = append(top, m.groupTable(st)...)

	var help []string
	if !m.report {
		order := groupOrders()[m.order]
		text := fmt.Sprintf("q quit  s sort groups (%s)  / filter sessions", order)
		switch {
		case m.typing:
			text = "filter: " + Printable(m.filter) + "_  (enter keep, esc clear)"
		case m.filter != "":
			text += fmt.Sprintf("  [filter %s, esc clears]", strconv.QuoteToGraphic(m.filter))
		}
		help = []string{"", st.dim.Render(text)}
	}
	// The sessions take the lines left; what does not fit is cut with a
	// sign, the help line stays.
	rows := m.sessions
	if m.height > 0 {
		left := m.height - len(top) - len(help) - 2 // a blank line and the heading
		rows = min(rows, max(left, 0))
		if left < 1 {
			rows = -1 // no room for the table at all
		}
		if room := m.height - len(help); len(top) > room && room > 0 {
			cut := len(top) - room + 1
			top = append(top[:room-1], st.dim.Render(fmt.Sprintf("… %d more lines: enlarge the terminal", cut)))
		}
	}
	lines := top
	if rows >= 0 {
		lines = append(lines, "")
		lines = append(lines, m.sessionTable(st, rows)...)
	}
	lines = append(lines, help...)
	if m.width > 0 {
		for i, l := range lines {
			lines[i] = ansi.Truncate(l, m.width, "…")
		}
	}
	return strings.Join(lines, "\n") + "\n"
}

// alert is text wrapped at its spaces, each line in the alert style.
func (m Model) alert(st styles, text string) []string {
	lines := m.wrap(strings.Fields(text), " ")
	for i, l := range lines {
		lines[i] = st.alert.Render(l)
	}
	return lines
}

// wrap joins parts with sep into lines no wider than m.width (a part
// wider than the line is cut with "…" at the end).
func (m Model) wrap(parts []string, sep string) []string {
	if m.width <= 0 {
		return []string{strings.Join(parts, sep)}
	}
	var lines []string
	cur := ""
	for _, p := range parts {
		switch {
		case cur == "":
			cur = p
		case ansi.StringWidth(cur)+ansi.StringWidth(sep)+ansi.StringWidth(p) <= m.width:
			cur += sep + p
		default:
			lines = append(lines, cur)
			cur = p
		}
	}
	return append(lines, cur)
}

// column is one column of a table: its heading, whether it is aligned
// right, and its priority: the lowest is dropped first when the table is
// too wide (0: never dropped).
type column struct {
	head     string
	right    bool
	priority int
}

// table lays out rows under cols within width (0: unbounded): columns are
// dropped by priority until it fits, then the first (flexible) column is
// cut. It returns the heading and the rows.
func table(cols []column, rows [][]string, width, flexMax int) (string, []string) {
	widths := make([]int, len(cols))
	for i, c := range cols {
		widths[i] = ansi.StringWidth(c.head)
		for _, r := range rows {
			widths[i] = max(widths[i], ansi.StringWidth(r[i]))
		}
	}
	if flexMax > 0 {
		widths[0] = min(widths[0], max(flexMax, ansi.StringWidth(cols[0].head)))
	}
	keep := make([]bool, len(cols))
	for i := range keep {
		keep[i] = true
	}
	total := func() int {
		n := -2
		for i, w := range widths {
			if keep[i] {
				n += w + 2
			}
		}
		return n
	}
	for width > 0 && total() > width {
		drop := -1
		for i, c := range cols {
			if keep[i] && c.priority > 0 && (drop < 0 || c.priority < cols[drop].priority) {
				drop = i
			}
		}
		if drop < 0 {
			break
		}
		keep[drop] = false
	}
	if width > 0 && total() > width {
		widths[0] = max(widths[0]-(total()-width), 4)
	}
	line := func(cells []string) string {
		var b strings.Builder
		first := true
		for i, c := range cols {
			if !keep[i] {
				continue
			}
			if !first {
				b.WriteString("  ")
			}
			first = false
			b.WriteString(pad(ansi.Truncate(cells[i], widths[i], "…"), widths[i], c.right))
		}
		return strings.TrimRight(b.String(), " ")
	}
	heads := make([]string, len(cols))
	for i, c := range cols {
		heads[i] = c.head
	}
	out := make([]string, len(rows))
	for i, r := range rows {
		out[i] = line(r)
	}
	return line(heads), out
}

// pad pads s with spaces to width columns of the terminal, on the left
// when right.
func pad(s string, width int, right bool) string {
	n := width - ansi.StringWidth(s)
	if n <= 0 {
		return s
	}
	if right {
		return strings.Repeat(" ", n) + s
	}
	return s + strings.Repeat(" ", n)
}

func (m Model) groupTable(st styles) []string {
	groups := append([]GroupRow(nil), m.snap.Groups...)
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
		return naturalLess(a.Name, c.Name)
	})
	cols := []column{{"GROUP", false, 0}, {"STATE", false, 0}, {"RANKS", true, 0}, {"INFLIGHT", true, 7},
		{"QUEUED_TOK", true, 5}, {"LOAD_TOK", true, 3}, {"BLOCKS", true, 6}, {"BYTES", true, 4},
		{"POOL_IN", true, 2}, {"POOL_OUT", true, 1}}
	// A MODEL column when the groups serve more than one model.
	models := map[string]bool{}
	for _, g := range groups {
		models[g.Model] = true
	}
	byModel := len(models) > 1
	if byModel {
		cols = slices.Insert(cols, 1, column{"MODEL", false, 8})
	}
	rows := make([][]string, len(groups))
	for i, g := range groups {
		state := g.State
		switch g.State {
		case "down":
			state = fmt.Sprintf("down (last heard %ds)", g.LastHeardMs/1000)
		case "conflict":
			state = "conflict (" + g.Conflict + ")"
		}
		if m.snap.Stale {
			state += " (stale)"
		}
		blocks := strconv.FormatInt(g.Blocks, 10)
		if g.CapacityBlocks > 0 {
			blocks += fmt.Sprintf("/%d %d%%", g.CapacityBlocks, g.Blocks*100/g.CapacityBlocks)
		}
		rows[i] = []string{Printable(g.Name), state, fmt.Sprintf("%d/%d", g.Ranks, g.WorldSize), strconv.Itoa(g.Inflight),
			strconv.FormatInt(g.QueuedPrefillTokens, 10), strconv.FormatInt(g.QueuedLoadTokens, 10), blocks,
			bytesString(g.Bytes), strconv.Itoa(g.PoolIn), strconv.Itoa(g.PoolOut)}
		if byModel {
			rows[i] = slices.Insert(rows[i], 1, Printable(g.Model))
		}
	}
	head, lines := table(cols, rows, m.width, 24)
	out := append([]string{st.head.Render(head)}, lines...)
	if len(groups) == 0 {
		out = append(out, st.dim.Render("no worker group heard yet"))
	}
	return out
}

// sessionTable is the heading and up to n sessions.
func (m Model) sessionTable(st styles, n int) []string {
	ss := m.snap.Sessions
	if len(ss) > n {
		ss = ss[:n]
	}
	cols := []column{{"SESSION", false, 0}, {"GROUP", false, 1}, {"TURNS", true, 2}, {"RECENT", true, 3}, {"HIT", true, 4}}
	// A MODEL column when the cluster serves more than one model: a
	// session id sent with two models is two conversations, two rows.
	models := map[string]bool{}
	for _, g := range m.snap.Groups {
		models[g.Model] = true
	}
	for _, s := range ss {
		models[s.Model] = true
	}
	byModel := len(models) > 1
	if byModel {
		cols = slices.Insert(cols, 1, column{"MODEL", false, 5})
	}
	rows := make([][]string, len(ss))
	for i, s := range ss {
		rows[i] = []string{Printable(s.ID), Printable(s.Group), strconv.Itoa(s.Turns), strconv.Itoa(s.Recent), fmt.Sprintf("%.2f", s.HitRatio)}
		if byModel {
			rows[i] = slices.Insert(rows[i], 1, Printable(s.Model))
		}
	}
	head, lines := table(cols, rows, m.width, 36)
	return append([]string{st.head.Render(head)}, lines...)
}

// Printable is s safe to print on a terminal: every rune that is not
// graphic (C0 and C1 controls such as ESC, format characters such as
// U+202E, line and paragraph separators) is escaped as strconv.Quote
// would (\x1b, \u202e), and so are invalid bytes and backslashes, so
// that what a bus publisher chose cannot move the cursor, retitle the
// window or fake rows. Other text, wide or not, is kept.
func Printable(s string) string {
	clean := true
	for _, r := range s {
		if r == '\\' || r == utf8.RuneError || !unicode.IsGraphic(r) {
			clean = false
			break
		}
	}
	if clean {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); {
		r, n := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && n == 1:
			fmt.Fprintf(&b, `\x%02x`, s[i])
		case r == '\\':
			b.WriteString(`\\`)
		case !unicode.IsGraphic(r):
			q := strconv.QuoteRuneToASCII(r)
			b.WriteString(q[1 : len(q)-1])
		default:
			b.WriteRune(r)
		}
		i += n
	}
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
