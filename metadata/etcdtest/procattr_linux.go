package etcdtest

import "syscall"

// sysProcAttr makes the kernel kill etcd when the thread that started it
// exits, so that a test binary that dies (a panic, go test's -timeout)
// leaves no etcd behind. The starting goroutine holds its thread until
// etcd exits; see Server.start.
func sysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
