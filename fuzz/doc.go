// Package fuzz holds the cross-package property tests and fuzz targets of
// moonring: an engine driven with arbitrary submission entries against
// guarded memory, checked against a byte-level model. It has no API; see
// its tests.
package fuzz
