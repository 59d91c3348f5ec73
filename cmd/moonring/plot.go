package main

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"math"
	"os"
	"slices"
	"time"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
)

// write draws bandwidth and p99 latency against block size, one line per
// transport and op, side by side, under a title that says what ran, into
// the file.
func (file *plotFile) write(results []result, run *runInfo) error {
	bw, lat := makePlots(results, run)
	const width, height = 1000, 440
	img := vgimg.New(vg.Points(width), vg.Points(height))
	dc := draw.New(img)
	sty := bw.Title.TextStyle
	sty.XAlign, sty.YAlign = draw.XCenter, draw.YTop
	dc.FillText(sty, vg.Point{X: vg.Points(width / 2), Y: vg.Points(height - 6)}, plotTitle(run))
	body := draw.Crop(dc, 0, 0, 0, -vg.Points(30))
	tiles := draw.Tiles{Rows: 1, Cols: 2, PadX: vg.Points(10)}
	canvases := plot.Align([][]*plot.Plot{{bw, lat}}, tiles, body)
	bw.Draw(canvases[0][0])
	lat.Draw(canvases[0][1])
	var png bytes.Buffer
	if _, err := (vgimg.PngCanvas{Canvas: img}).WriteTo(&png); err != nil {
		return fmt.Errorf("plot: %w", err)
	}
	return file.replace(png.Bytes())
}

// plotTitle says what the plot shows: transport, mode, batch, threads,
// API, host and date.
func plotTitle(r *runInfo) string {
	mode := fmt.Sprintf("batch %d, threads %d", r.Batch, r.Threads)
	if r.Mode == "lat" {
		mode = "one request in flight"
	}
	date := r.Date
	if t, err := time.Parse(time.RFC3339, r.Date); err == nil {
		date = t.Format("2006-01-02 15:04 MST")
	}
	return fmt.Sprintf("moonring bench: %s, %s, %s API, host %s, %s", r.Transport, mode, r.API, r.Host, date)
}

// makePlots makes the two plots: GB/s from 0, and p99 latency on a log
// scale, both against block size on a log scale with ticks in sizes (4K,
// 64K, 1M, 16M) and latencies in µs and ms.
func makePlots(results []result, run *runInfo) (bw, lat *plot.Plot) {
	bw = plot.New()
	bw.Title.Text = "bandwidth"
	bw.X.Label.Text = "block size"
	bw.Y.Label.Text = "GB/s"
	bw.Y.Min = 0
	lat = plot.New()
	lat.Title.Text = "p99 latency"
	if run != nil && run.Mode != "lat" {
		lat.Title.Text = fmt.Sprintf("p99 latency (batch %d: queueing included)", run.Batch)
	}
	lat.X.Label.Text = "block size"
	lat.Y.Label.Text = "latency"
	series := map[string][2]plotter.XYs{}
	var order []string
	var sizes []int
	for _, r := range results {
		key := r.Transport + " " + r.Op
		if _, ok := series[key]; !ok {
			order = append(order, key)
		}
		if !slices.Contains(sizes, r.BlockSize) {
			sizes = append(sizes, r.BlockSize)
		}
		s := series[key]
		x := float64(r.BlockSize)
		s[0] = append(s[0], plotter.XY{X: x, Y: r.GBps})
		s[1] = append(s[1], plotter.XY{X: x, Y: max(r.P99us, 0.001)})
		series[key] = s
	}
	slices.Sort(sizes)
	for _, p := range []*plot.Plot{bw, lat} {
		p.X.Scale = plot.LogScale{}
		p.X.Tick.Marker = sizeTicks(sizes)
		if len(sizes) == 1 { // a log axis needs a range: half and twice the one size
			p.X.Min, p.X.Max = float64(sizes[0])/2, float64(sizes[0])*2
		}
	}
	lat.Y.Scale = plot.LogScale{}
	lat.Y.Tick.Marker = plot.TickerFunc(latencyTicks)
	for i, key := range order {
		for k, p := range []*plot.Plot{bw, lat} {
			l, pts, err := plotter.NewLinePoints(series[key][k])
			if err != nil {
				continue
			}
			l.Color = plotutil.Color(i)
			l.Dashes = plotutil.Dashes(i)
			pts.Color = plotutil.Color(i)
			pts.Shape = plotutil.Shape(i)
			p.Add(l, pts)
			p.Legend.Add(key, l, pts)
		}
	}
	if bw.Y.Max <= 0 {
		bw.Y.Max = 1
	}
	return bw, lat
}

// sizeTicks marks the block sizes measured, labelled as the flags write
// them.
func sizeTicks(sizes []int) plot.Ticker {
	ticks := make(plot.ConstantTicks, len(sizes))
	for i, n := range sizes {
		ticks[i] = plot.Tick{Value: float64(n), Label: fmtSize(n)}
	}
	return ticks
}

// latencyTicks marks 1, 2 and 5 of each decade of µs between min and max,
// labelled in ns, µs, ms or s ("500 µs", "1 ms").
func latencyTicks(min, max float64) []plot.Tick {
	if min <= 0 {
		min = 0.001
	}
	ticks := decadeTicks(min, max, []float64{1, 2, 5})
	if len(ticks) < 3 { // a narrow range: every step of its decades
		ticks = decadeTicks(min, max, []float64{1, 2, 3, 4, 5, 6, 7, 8, 9})
	}
	if len(ticks) < 3 { // narrower still: linear steps, labelled in time
		ticks = plot.DefaultTicks{}.Ticks(min, max)
		for i := range ticks {
			if ticks[i].Label != "" {
				ticks[i].Label = fmtMicros(ticks[i].Value)
			}
		}
	}
	return ticks
}

// decadeTicks marks the multiples mults of each power of ten between min
// and max.
func decadeTicks(min, max float64, mults []float64) []plot.Tick {
	var ticks []plot.Tick
	for dec := math.Pow(10, math.Floor(math.Log10(min))); dec <= max; dec *= 10 {
		for _, m := range mults {
			if v := m * dec; v >= min*0.999 && v <= max*1.001 {
				ticks = append(ticks, plot.Tick{Value: v, Label: fmtMicros(v)})
			}
		}
	}
	return ticks
}

// fmtMicros writes a time given in µs in the unit that suits it.
func fmtMicros(us float64) string {
	d := time.Duration(us * 1e3)
	switch {
	case d < time.Microsecond:
		return fmt.Sprintf("%g ns", math.Round(us*1e3*100)/100)
	case d < time.Millisecond:
		return fmt.Sprintf("%g µs", math.Round(us*100)/100)
	case d < time.Second:
		return fmt.Sprintf("%g ms", math.Round(us/1e3*100)/100)
	}
	return fmt.Sprintf("%g s", math.Round(us/1e6*100)/100)
}

// plotFile is the plot's file, opened before the sweep so that a path
// that cannot be written is found before any measuring.
type plotFile struct {
	f       *os.File
	created bool // the file did not exist: abandon removes it
	done    bool
}

// openPlot opens (or creates) name for writing, without truncating it yet.
func openPlot(name string) (*plotFile, error) {
	_, statErr := os.Stat(name)
	f, err := os.OpenFile(name, os.O_WRONLY|os.O_CREATE, 0o644)
	if err != nil {
		return nil, err
	}
	return &plotFile{f: f, created: errors.Is(statErr, fs.ErrNotExist)}, nil
}

// replace makes b the file's content and closes it.
func (p *plotFile) replace(b []byte) error {
	p.done = true
	err := p.f.Truncate(0)
	if err == nil {
		_, err = p.f.WriteAt(b, 0)
	}
	return errors.Join(err, p.f.Close())
}

// abandon closes a file that was not written, removing it if openPlot
// created it.
func (p *plotFile) abandon() {
	if p.done {
		return
	}
	p.done = true
	p.f.Close()
	if p.created {
		os.Remove(p.f.Name())
	}
}
