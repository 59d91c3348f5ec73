// Command moonring runs and inspects the moonring transfer engine.
//
//	moonring bench [flags]            sweep WRITE/READ over block sizes (--lat: one request in flight), a row per step
//	moonring serve [flags]            a standing target, with /metrics and /healthz
//	moonring metadata-server [flags]  serve segment descriptors to http metadata stores
//	moonring info                     machine topology, transports, effective config
//	moonring version                  the build's module version and VCS revision
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"

	"github.com/moonring/moonring"
	"github.com/moonring/moonring/efa"
	"github.com/moonring/moonring/rdma"
	"github.com/moonring/moonring/topology"
)

func main() {
	err := run(os.Args[1:], os.Stdout)
	if err != nil && !errors.Is(err, flag.ErrHelp) { // -h: the usage is printed, as asked
		fmt.Fprintln(os.Stderr, errText(err))
	}
	os.Exit(exitCode(err))
}

// errText is err as main prints it: one "moonring:" prefix, whatever the
// errors wrapped inside it begin with.
func errText(err error) string {
	return "moonring: " + strings.ReplaceAll(err.Error(), "moonring: ", "")
}

func usage(w io.Writer) {
	fmt.Fprint(w, `usage: moonring <command> [flags]

commands:
  bench   move bytes to a target (a child process over TCP by default) and
          report GB/s, req/s and latency (--lat: one request in flight);
          --mode target serves one
  serve   a standing target: serve a buffer over TCP (--tls: TLS 1.3) and
          shm until signalled, with /metrics and /healthz
  info    show NUMA nodes, CPU features, NICs, transports and the config
  metadata-server  serve segment descriptors to http metadata stores (--listen, --dir)
  version print the module version and the VCS revision it was built from
          (also --version)

serve and bench take the segment key from --key-file FILE or from the
environment variable MOONRING_KEY; "moonring <command> -h" says more.
`)
}

// parseFlags parses a subcommand's flags. Its -h prints help, the flags'
// defaults and returns flag.ErrHelp (main exits 0 on it); other mistakes
// come back as one error, which main prints once. Stray arguments are
// refused: every subcommand takes flags only.
func parseFlags(fs *flag.FlagSet, args []string, out io.Writer, help string) error {
	fs.SetOutput(io.Discard)
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			fmt.Fprint(out, help)
			fs.SetOutput(out)
			fs.PrintDefaults()
			return err
		}
		return fmt.Errorf("%s: %w", fs.Name(), err)
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("%s: unexpected arguments %q (flags only)", fs.Name(), fs.Args())
	}
	return nil
}

const infoHelp = `usage: moonring info

Show NUMA nodes, CPU features, NICs, RDMA devices, the transports of this
build and the engine's effective configuration. It opens no connection and
reads no segment key (MOONRING_KEY and --key-file are serve's and bench's).
`

func run(args []string, out io.Writer) error {
	if len(args) == 0 {
		usage(os.Stderr)
		return errors.New("no command given")
	}
	switch args[0] {
	case "bench":
		return bench(args[1:], out)
	case "info":
		if err := parseFlags(flag.NewFlagSet("info", flag.ContinueOnError), args[1:], out, infoHelp); err != nil {
			return err
		}
		return info(out)
	case "metadata-server":
		return metaServer(args[1:], out)
	case "serve":
		return serve(args[1:], out, nil)
	case "version", "-version", "--version":
		if len(args) > 1 {
			return fmt.Errorf("version: unexpected arguments %q", args[1:])
		}
		fmt.Fprintf(out, "moonring %s\n", version())
		return nil
	case "-h", "-help", "--help", "help":
		usage(out)
		return nil
	}
	usage(os.Stderr)
	return fmt.Errorf("unknown command %q", args[0])
}

func info(out io.Writer) error {
	e, err := moonring.New(moonring.Config{})
	if err != nil {
		return err
	}
	defer e.Close()
	t := e.Topology()
	ncpu := 0
	for _, n := range t.Nodes {
		ncpu += len(n.CPUs)
	}
	fmt.Fprintln(out, cpuLine(t.CPU, ncpu))
	fmt.Fprintf(out, "cpu features: %s\n", strings.Join(t.CPU.Features, " "))
	for _, n := range t.Nodes {
		fmt.Fprintf(out, "numa node %d: cpus %v, memory %d MiB\n", n.ID, n.CPUs, n.MemoryBytes>>20)
	}
	nics, err := t.NICs()
	if err != nil {
		fmt.Fprintf(out, "nics: %v\n", err)
	}
	for _, n := range nics {
		fmt.Fprintln(out, nicLine(n))
	}
	devs, err := rdma.Devices()
	if err != nil {
		rdevs, _ := t.RDMADevices()
		for _, d := range rdevs {
			fmt.Fprintf(out, "rdma device %s: numa node %s\n", d.Name, nodeText(d.Node))
		}
	}
	for _, d := range devs {
		fmt.Fprintf(out, "rdma device %s: numa node %s\n", d.Name, nodeText(d.NUMANode))
		for _, p := range d.Ports {
			fmt.Fprintf(out, "  port %d: %s, %s, mtu %d, lid %d\n", p.Port, p.State, p.LinkLayer, p.MTU, p.LID)
			for i, g := range p.GIDs {
				mark := ""
				if i == p.Chosen {
					mark = " (chosen)"
				}
				fmt.Fprintf(out, "    gid %s%s\n", g, mark)
			}
		}
	}
	fmt.Fprintln(out, "transports:")
	// probe says whether a transport can be made here, and if not why.
	probe := func(t interface{ Close() error }, err error) func(how string) string {
		if err == nil {
			t.Close()
		}
		return func(how string) string {
			if err != nil {
				return "not available: " + strings.ReplaceAll(err.Error(), "\n", "; ")
			}
			return "usable: " + how
		}
	}
	for _, tr := range []struct{ name, why string }{
		{"local", "usable: memcpy between engines of one process (always installed)"},
		{"nvlink", "not in this command: a program installs it with e.InstallTransport(nvlink.New(...)) where libcuda.so.1 exists"},
		{"shm", "usable: Config.SHM installs it; same-host peers (moonring bench --protocol shm)"},
		{"rdma", probe(rdma.New(rdma.Config{}))("Config.RDMA installs it")},
		{"efa", probe(efa.New(efa.Config{}))("InstallTransport(efa.New(...))")},
		{"tcp", "usable: Config.TCP installs it (moonring bench --protocol tcp)"},
	} {
		fmt.Fprintf(out, "  %-7s %s\n", tr.name, tr.why)
	}
	fmt.Fprintf(out, "config:\n%s", indent(e.Config().String()))
	return nil
}

// cpuLine describes the CPU. CPUID's count of logical cores per socket is
// "unknown" when it is 0 or more than the machine's ncpu CPUs (virtual
// machines report 254 or 255).
func cpuLine(c topology.CPUInfo, ncpu int) string {
	cores := "logical cores per socket unknown"
	switch {
	case c.LogicalCores > 0 && (ncpu == 0 || c.LogicalCores <= ncpu):
		cores = fmt.Sprintf("%d logical cores per socket", c.LogicalCores)
	case c.LogicalCores > 0:
		cores = fmt.Sprintf("logical cores per socket unknown (CPUID says %d, more than the %d CPUs of this machine)", c.LogicalCores, ncpu)
	}
	return fmt.Sprintf("cpu: %s (%s), %s, cache line %d B", c.Brand, c.Vendor, cores, c.CacheLine)
}

// nicLine describes a NIC; a NUMA node or speed the kernel does not know
// (-1: a virtual device, a link down) is "unknown".
func nicLine(n topology.NIC) string {
	node, speed := nodeText(n.Node), "unknown"
	if n.Speed > 0 {
		speed = strconv.Itoa(n.Speed) + " Mb/s"
	}
	return fmt.Sprintf("nic %s: numa node %s, speed %s", n.Name, node, speed)
}

// nodeText is a device's NUMA node, "unknown" for the kernel's -1.
func nodeText(node int) string {
	if node < 0 {
		return "unknown"
	}
	return strconv.Itoa(node)
}

func indent(s string) string {
	return "  " + strings.ReplaceAll(strings.TrimRight(s, "\n"), "\n", "\n  ") + "\n"
}

// ctxMain is the context of a command; bench stops on it.
var ctxMain = context.Background()
