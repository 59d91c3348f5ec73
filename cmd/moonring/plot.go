package main

import (
	"fmt"
	"math"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
)

// plotResults draws bandwidth and p99 latency against block size, one line
// per transport and op, side by side, into a PNG file.
func plotResults(results []result, file string) error {
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
	w, err := createFile(file)
	if err != nil {
		return err
	}
	defer w.Close()
	if _, err := (vgimg.PngCanvas{Canvas: img}).WriteTo(w); err != nil {
		return fmt.Errorf("plot: %w", err)
	}
	return w.Close()
}
