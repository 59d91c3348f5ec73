package uring

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/moonring/moonring/internal/childproc"
)

// blockEnv makes the test binary refuse itself io_uring_setup (EPERM, as
// a container runtime's seccomp profile does) before its tests run.
const blockEnv = "URING_TEST_BLOCK"

func init() {
	if os.Getenv(blockEnv) == "" {
		return
	}
	if err := blockSetup(); err != nil {
		fmt.Fprintln(os.Stderr, "uring test: cannot install the seccomp filter:", err)
		os.Exit(3)
	}
}

// blockSetup installs, on every thread of the process, a seccomp filter
// that answers io_uring_setup with EPERM and allows everything else.
func blockSetup() error {
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return err
	}
	filter := []unix.SockFilter{
		{Code: unix.BPF_LD | unix.BPF_W | unix.BPF_ABS, K: 0}, // seccomp_data.nr
		{Code: unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K, K: unix.SYS_IO_URING_SETUP, Jt: 0, Jf: 1},
		{Code: unix.BPF_RET | unix.BPF_K, K: unix.SECCOMP_RET_ERRNO | uint32(unix.EPERM)},
		{Code: unix.BPF_RET | unix.BPF_K, K: unix.SECCOMP_RET_ALLOW},
	}
	prog := unix.SockFprog{Len: uint16(len(filter)), Filter: &filter[0]}
	if _, _, errno := unix.Syscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER, unix.SECCOMP_FILTER_FLAG_TSYNC,
		uintptr(unsafe.Pointer(&prog))); errno != 0 {
		return errno
	}
	return nil
}

// Where io_uring is refused, the tests skip saying why, and under
// MOONRING_CI=1 they fail instead: the test binary runs again with
// io_uring_setup refused by seccomp, once as CI and once not.
func TestUnusableFailsInCI(t *testing.T) {
	run := func(ci string) (string, error) {
		out, err := childproc.Run(childproc.Config{Env: []string{blockEnv + "=1", "MOONRING_CI=" + ci},
			Args: []string{"-test.v", "-test.run=^(TestCloseTwice|TestAvailableCached|TestUsed)$"}}, 2*time.Minute)
		return string(out), err
	}
	out, err := run("1")
	if err == nil || !strings.Contains(out, "--- FAIL: TestCloseTwice") || !strings.Contains(out, "--- FAIL: TestUsed") ||
		!strings.Contains(out, "io_uring not usable under MOONRING_CI=1") || !strings.Contains(out, "not permitted") {
		t.Fatalf("io_uring refused under MOONRING_CI=1: %v\n%s", err, out)
	}
	out, err = run("")
	if err != nil || strings.Count(out, "--- SKIP") != 3 || !strings.Contains(out, "SKIP io_uring") {
		t.Fatalf("io_uring refused outside CI: %v, want 3 skips\n%s", err, out)
	}
}
