package main

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"math"
	"os"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
)

// plotResults draws bandwidth and p99 latency against block size, one line
// per transport and op, side by side, into a PNG file.
func (file *plotFile) write(results []result) error {
	bw := plot.New()
	bw.Title.Text = "bandwidth"
	bw.X.Label.Text = "block size (log2 bytes)"
	bw.Y.Label.Text = "GB/s"
	lat := plot.New()
	lat.Title.Text = "p99 latency"
	lat.X.Label.Text = "block size (log2 bytes)"
	lat.Y.Label.Text = "µs (log10)"
	series := map[string][2]plotter.XYs{}
	var order []string
	for _, r := range results {
		key := r.Transport + " " + r.Op
		if _, ok := series[key]; !ok {
			order = append(order, key)
		}
		s := series[key]
		x := math.Log2(float64(r.BlockSize))
		s[0] = append(s[0], plotter.XY{X: x, Y: r.GBps})
		s[1] = append(s[1], plotter.XY{X: x, Y: math.Log10(max(r.P99us, 0.001))})
		series[key] = s
	}
	for i, key := range order {
		for k, p := range []*plot.Plot{bw, lat} {
			l, pts, err := plotter.NewLinePoints(series[key][k])
			if err != nil {
				return err
			}
			l.Color = plotutil.Color(i)
			l.Dashes = plotutil.Dashes(i)
			pts.Color = plotutil.Color(i)
			pts.Shape = plotutil.Shape(i)
			p.Add(l, pts)
			p.Legend.Add(key, l, pts)
		}
	}
	img := vgimg.New(vg.Points(1000), vg.Points(400))
	dc := draw.New(img)
	tiles := draw.Tiles{Rows: 1, Cols: 2, PadX: vg.Points(10)}
	canvases := plot.Align([][]*plot.Plot{{bw, lat}}, tiles, dc)
	bw.Draw(canvases[0][0])
	lat.Draw(canvases[0][1])
	var png bytes.Buffer
	if _, err := (vgimg.PngCanvas{Canvas: img}).WriteTo(&png); err != nil {
		return fmt.Errorf("plot: %w", err)
	}
	return file.replace(png.Bytes())
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
