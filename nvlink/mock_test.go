package nvlink

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/moonring/moonring/internal/childproc"
)

// TestMockCUDA runs the GPU tests and benchmarks in a subprocess against
// testdata/mockcuda.c, a C model of libcuda built here: the real driver
// layer (purego bindings, the by-value IPC handle, out-parameters, CUresult
// codes) and the two-process path with a real grant table and memory
// shared between processes run without a GPU. It proves the bindings
// agree with a C ABI, not that CUDA behaves like the model.
func TestMockCUDA(t *testing.T) {
	if os.Getenv(libraryEnv) != "" {
		t.Skip("already running against a test library")
	}
	cc, err := exec.LookPath("cc")
	if err != nil {
		if os.Getenv("MOONRING_CI") != "" {
			t.Fatalf("no C compiler to build the CUDA model (apt-get install gcc): %v", err)
		}
		t.Skipf("no C compiler to build the CUDA model: %v", err)
	}
	lib := filepath.Join(t.TempDir(), "libmockcuda.so")
	if out, err := exec.Command(cc, "-Wall", "-Werror", "-shared", "-fPIC", "-o", lib, "testdata/mockcuda.c").CombinedOutput(); err != nil {
		t.Fatalf("build the CUDA model: %v\n%s", err, out)
	}
	out, err := childproc.Run(childproc.Config{Env: []string{libraryEnv + "=" + lib},
		Args: []string{"-test.run", "^TestGPU", "-test.v", "-test.count=1",
			"-test.bench", "NVLink|RawDtoD|RawKV|StagedTCP", "-test.benchtime", "2x"}}, 5*time.Minute)
	if err != nil {
		t.Fatalf("GPU tests against the model: %v\n%s", err, out)
	}
	for _, want := range []string{"--- PASS: TestGPUDriverError", "--- PASS: TestGPUTwoProcesses", "--- PASS: TestGPUStagingTCP", "--- PASS: TestGPUEngineStaging", "--- PASS: TestGPUEngineNVLink", "--- PASS: TestGPUScattered", "BenchmarkKVNVLink", "BenchmarkRawKV", "BenchmarkNVLinkWrite", "BenchmarkNVLinkRead", "BenchmarkRawDtoD", "BenchmarkStagedTCP", "BenchmarkEngineNVLink"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("no %q in the output:\n%s", want, out)
		}
	}
	if strings.Contains(string(out), "SKIP") {
		t.Errorf("a GPU test skipped against the model:\n%s", out)
	}
}
