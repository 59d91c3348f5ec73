//go:build !linux

package etcdtest

import "syscall"

// sysProcAttr is nil where there is no parent-death signal: an etcd left
// behind by a test binary that dies must be killed by hand.
func sysProcAttr() *syscall.SysProcAttr { return nil }
