//go:build efa && cgo

package efa_test

import "os"

func runChild() bool { return os.Getenv("EFA_CHILD") != "" && false }
