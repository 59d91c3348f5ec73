// Package proccpu reads the CPU time a process or thread has used: this
// process's and the calling thread's from getrusage, another process's
// from /proc/PID/stat. Benchmarks and `moonring bench --cpu` sample it
// around a measured window to report CPU per GB or per request on each
// side. Every function is safe for concurrent use.
package proccpu

import (
	"bytes"
	"fmt"
	"os"
	"strconv"
	"time"

	"golang.org/x/sys/unix"
)

// clockTick is the unit of utime and stime in /proc/PID/stat (USER_HZ,
// 100 on every Linux architecture Go runs on).
const clockTick = 10 * time.Millisecond

func rusage(who int) time.Duration {
	var ru unix.Rusage
	if unix.Getrusage(who, &ru) != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// Self is the user and system time of this process, all its threads.
func Self() time.Duration { return rusage(unix.RUSAGE_SELF) }

// Thread is the calling thread's user and system time; the goroutine must
// be locked to its thread (runtime.LockOSThread) for two readings to be
// of one thread.
func Thread() time.Duration { return rusage(unix.RUSAGE_THREAD) }

// Of is the user and system time of process pid, all its threads, from
// /proc/PID/stat, in steps of the kernel's clock tick (10 ms).
func Of(pid int) (time.Duration, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, err
	}
	// The command name, in parentheses, may hold spaces: fields count
	// from after its last ')'. utime and stime are fields 14 and 15.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, fmt.Errorf("/proc/%d/stat: no ')'", pid)
	}
	f := bytes.Fields(b[i+1:])
	if len(f) < 13 {
		return 0, fmt.Errorf("/proc/%d/stat: %d fields", pid, len(f)+2)
	}
	ut, err1 := strconv.ParseInt(string(f[11]), 10, 64)
	st, err2 := strconv.ParseInt(string(f[12]), 10, 64)
	if err1 != nil || err2 != nil {
		return 0, fmt.Errorf("/proc/%d/stat: bad utime or stime", pid)
	}
	return time.Duration(ut+st) * clockTick, nil
}
