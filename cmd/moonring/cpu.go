// cpu.go holds bench --cpu: the CPU time of this process (getrusage) and of
// the target processes it started (/proc/PID/stat), sampled at the start
// and the end of a step's measured window, per GB moved in it.

package main

import (
	"fmt"
	"time"

	"github.com/moonring/moonring/internal/proccpu"
)

// cpuSample is the CPU time of each side at one moment and the bytes
// moved until then.
type cpuSample struct {
	at     time.Time
	self   time.Duration
	target time.Duration
	moved  int64
	err    error
}

// cpuWindow samples both sides at the start and the end of a window.
type cpuWindow struct {
	pids []int // the target processes; none in-process
	a, b cpuSample
	done chan struct{}
}

func takeSample(pids []int) cpuSample {
	s := cpuSample{at: time.Now(), self: proccpu.Self(), moved: moved.Load()}
	for _, pid := range pids {
		c, err := proccpu.Of(pid)
		if err != nil && s.err == nil {
			s.err = err
		}
		s.target += c
	}
	return s
}

// startCPUWindow samples at from and at to, on a goroutine of its own.
func startCPUWindow(t *target, from, to time.Time) *cpuWindow {
	w := &cpuWindow{done: make(chan struct{})}
	for _, p := range t.peers {
		if p.started && p.pid > 0 {
			w.pids = append(w.pids, p.pid)
		}
	}
	go func() {
		defer close(w.done)
		time.Sleep(time.Until(from))
		w.a = takeSample(w.pids)
		time.Sleep(time.Until(to))
		w.b = takeSample(w.pids)
	}()
	return w
}

func (w *cpuWindow) wait() { <-w.done }

// fill sets res's CPU figures: bytes moved in the window (the moved
// count's difference when gb is 0), less the CPU time of checks made
// inside it (spent).
func (w *cpuWindow) fill(res *result, bytesIn float64, spent time.Duration) {
	if bytesIn == 0 {
		bytesIn = float64(w.b.moved - w.a.moved)
	}
	if bytesIn <= 0 {
		res.Note = joinNote(res.Note, "--cpu: no bytes moved in the window")
		return
	}
	gb := bytesIn / 1e9
	self := (w.b.self - w.a.self - spent).Seconds()
	res.CPUIni = self / gb
	res.CPUIniUtil = self / w.b.at.Sub(w.a.at).Seconds()
	switch {
	case len(w.pids) == 0:
		res.Note = joinNote(res.Note, "--cpu: the target is in this process (or not started by it): the initiator's figure counts the whole process")
		res.CPUTgt = -1
	case w.a.err != nil || w.b.err != nil:
		res.Note = joinNote(res.Note, fmt.Sprintf("--cpu: the target's CPU: %v", errorsJoin(w.a.err, w.b.err)))
		res.CPUTgt = -1
	default:
		tg := (w.b.target - w.a.target).Seconds()
		res.CPUTgt = tg / gb
		res.CPUTgtUtil = tg / w.b.at.Sub(w.a.at).Seconds()
	}
}

func errorsJoin(a, b error) error {
	if a != nil {
		return a
	}
	return b
}

func joinNote(a, b string) string {
	if a == "" {
		return b
	}
	return a + "; " + b
}
