package rails

import (
	"container/heap"
	"fmt"
	"testing"
	"time"
)

// model is a discrete-event model of rails fed through a Picker as a
// transport feeds it: each rail is a pipelined link (a slice posted at t
// completes at max(t + latency + size/speed, the previous completion +
// size/speed)) with a closed loop of depth slices in flight, a new slice
// picked at each completion. Completions feed Done as tcp's do.
type model struct {
	p      *Picker
	now    int64
	speed  []float64 // bytes per nanosecond, per rail
	lat    int64
	size   uint64
	last   []int64 // each rail's last completion
	events events
	picks  []int
}

type event struct {
	done, posted int64
	rail         int
}

type events []event

func (e events) Len() int           { return len(e) }
func (e events) Less(i, j int) bool { return e[i].done < e[j].done }
func (e events) Swap(i, j int)      { e[i], e[j] = e[j], e[i] }
func (e *events) Push(x any)        { *e = append(*e, x.(event)) }
func (e *events) Pop() any {
	old := *e
	x := old[len(old)-1]
	*e = old[:len(old)-1]
	return x
}

func newModel(t *testing.T, depth int, lat time.Duration, size uint64, speed ...float64) *model {
	m := &model{speed: speed, lat: int64(lat), size: size, last: make([]int64, len(speed)), picks: make([]int, len(speed))}
	// A half-life of 10 ms: 2500 of the 4 KiB slices of the fast rail.
	m.p = newPicker(t, len(speed), Config{HalfLife: 10 * time.Millisecond, Now: func() int64 { return m.now }})
	for range depth {
		m.post()
	}
	return m
}

// post picks a rail for a slice posted now.
func (m *model) post() {
	r := m.p.Pick()
	m.picks[r]++
	service := int64(float64(m.size) / m.speed[r])
	done := max(m.now+m.lat+service, m.last[r]+service)
	heap.Push(&m.events, event{done: done, posted: m.now, rail: r})
	m.last[r] = done
}

// run completes n slices, posting one for each.
func (m *model) run(n int) {
	for range n {
		e := heap.Pop(&m.events).(event)
		m.now = e.done
		m.p.Done(e.rail, m.size, e.posted, e.done)
		m.post()
	}
}

// share returns each rail's share of the picks since the last call.
func (m *model) share() []float64 {
	n := 0
	for _, c := range m.picks {
		n += c
	}
	out := make([]float64, len(m.picks))
	for i, c := range m.picks {
		out[i] = float64(c) / float64(n)
		m.picks[i] = 0
	}
	return out
}

// TestModelSlowRail: against the model, a rail four times slower than
// another gets a fifth of the slices (the rate ratio), and three rails at
// 1, 0.5 and 0.25 get 4/7, 2/7, 1/7, with 1 MiB and with 4 KiB slices
// (where the latency is most of an idle slice's time).
func TestModelSlowRail(t *testing.T) {
	for _, c := range []struct {
		name  string
		size  uint64
		speed []float64
		want  []float64
	}{
		{"1MiB 1x 0.25x", 1 << 20, []float64{1, 0.25}, []float64{0.8, 0.2}},
		{"4KiB 1x 0.25x", 4 << 10, []float64{1, 0.25}, []float64{0.8, 0.2}},
		{"1MiB 1x 0.5x 0.25x", 1 << 20, []float64{1, 0.5, 0.25}, []float64{4.0 / 7, 2.0 / 7, 1.0 / 7}},
	} {
		t.Run(c.name, func(t *testing.T) {
			m := newModel(t, 64, 50*time.Microsecond, c.size, c.speed...)
			m.run(20000) // measured, and the queues settled
			m.share()
			m.run(50000)
			near(t, c.name, m.share(), c.want, 0.01)
		})
	}
}

// TestModelWrongStart: rails that start with their rates the wrong way
// round (the fast one measured at a tenth of the slow one) find their
// speeds: the fast rail, with room, is offered more until it backs up,
// rather than settling where it is offered only what it was measured at.
func TestModelWrongStart(t *testing.T) {
	for _, depth := range []int{64, 16} {
		m := newModel(t, 0, 50*time.Microsecond, 4<<10, 1, 0.25)
		setRates(m.p, 0.1e9, 1e9)
		for range depth {
			m.post()
		}
		m.run(60000)
		m.share()
		m.run(40000)
		near(t, fmt.Sprintf("depth %d", depth), m.share(), []float64{0.8, 0.2}, 0.04)
	}
}

// TestModelSlowsDown: a rail that slows from 1x to 0.25x mid-run loses
// its slices to the other within some half-lives, and wins them back when
// it is fast again.
func TestModelSlowsDown(t *testing.T) {
	m := newModel(t, 64, 50*time.Microsecond, 1<<20, 1, 1)
	m.run(20000)
	near(t, "alike", m.share(), []float64{0.5, 0.5}, 0.01)
	m.speed[1] = 0.25
	m.run(20000) // seconds: many half-lives
	m.share()
	m.run(20000)
	near(t, "rail 1 slowed", m.share(), []float64{0.8, 0.2}, 0.01)
	m.speed[1] = 1
	m.run(20000)
	m.share()
	m.run(20000)
	near(t, "rail 1 fast again", m.share(), []float64{0.5, 0.5}, 0.01)
}

// TestModelLightLoad: with two slices in flight over two alike rails,
// most slices find their rail idle, so both have room and weigh what they
// complete, times roomGain alike: the rails keep about half each.
func TestModelLightLoad(t *testing.T) {
	m := newModel(t, 2, 200*time.Microsecond, 4<<10, 1, 1)
	m.run(20000)
	m.share()
	m.run(20000)
	near(t, "light load", m.share(), []float64{0.5, 0.5}, 0.05)
}
