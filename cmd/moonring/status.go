// status.go holds how a step's requests ended: their counts by terminal
// status (and, for FAILED, by error code), kept by each goroutine of a
// step and summed at its end, what a goroutine keeps of its requests' ends
// (under --keep-going a failure is counted and the work goes on), and the
// error of a step whose requests did not all complete.

package main

import (
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/moonring/moonring"
	"github.com/moonring/moonring/cq"
)

// statusCounts counts a step's requests: every request it submitted (its
// warm-up's and its checks' read-backs too) once when submitted and once
// more, under its terminal status, when it ended. The four terminal
// counts add up to Submitted: a request counted in none would be one that
// never ended (the step would not have ended either), one counted twice an
// engine that ended it twice.
type statusCounts struct {
	Submitted int `json:"submitted"`
	Completed int `json:"completed"`
	Failed    int `json:"failed"`
	Timeout   int `json:"timeout"`
	Canceled  int `json:"canceled"`
	// FailedBy counts the FAILED ones by error code (codeName).
	FailedBy map[string]int `json:"failed_by_code,omitempty"`
}

// submitted counts n requests handed to the engine.
func (c *statusCounts) submitted(n int) { c.Submitted += n }

// ended counts a request that ended with st and code; a status that is
// not terminal is not counted (the sum then falls short of Submitted).
func (c *statusCounts) ended(st moonring.Status, code moonring.Code) {
	switch st {
	case moonring.COMPLETED:
		c.Completed++
	case moonring.TIMEOUT:
		c.Timeout++
	case moonring.CANCELED:
		c.Canceled++
	case moonring.FAILED:
		c.Failed++
		if c.FailedBy == nil {
			c.FailedBy = map[string]int{}
		}
		c.FailedBy[codeName(code)]++
	}
}

// add adds o's counts to c's.
func (c *statusCounts) add(o statusCounts) {
	c.Submitted += o.Submitted
	c.Completed += o.Completed
	c.Failed += o.Failed
	c.Timeout += o.Timeout
	c.Canceled += o.Canceled
	for k, v := range o.FailedBy {
		if c.FailedBy == nil {
			c.FailedBy = map[string]int{}
		}
		c.FailedBy[k] += v
	}
}

// notCompleted is the requests that ended otherwise than COMPLETED.
func (c statusCounts) notCompleted() int { return c.Failed + c.Timeout + c.Canceled }

// String says the counts as the table prints them: "1234 submitted: 1230
// COMPLETED, 3 FAILED (transport 3), 1 TIMEOUT"; a terminal status none
// ended with is left out.
func (c statusCounts) String() string {
	parts := []string{fmt.Sprintf("%d COMPLETED", c.Completed)}
	if c.Failed > 0 {
		var by []string
		for _, k := range slices.Sorted(maps.Keys(c.FailedBy)) {
			by = append(by, fmt.Sprintf("%s %d", k, c.FailedBy[k]))
		}
		parts = append(parts, fmt.Sprintf("%d FAILED (%s)", c.Failed, strings.Join(by, ", ")))
	}
	if c.Timeout > 0 {
		parts = append(parts, fmt.Sprintf("%d TIMEOUT", c.Timeout))
	}
	if c.Canceled > 0 {
		parts = append(parts, fmt.Sprintf("%d CANCELED", c.Canceled))
	}
	return fmt.Sprintf("%d submitted: %s", c.Submitted, strings.Join(parts, ", "))
}

// codeNames names the error codes in FailedBy.
var codeNames = map[moonring.Code]string{
	cq.CodeOK: "ok", cq.CodeInvalid: "invalid", cq.CodeBadBuffer: "bad_buffer", cq.CodeLocalRange: "local_range",
	cq.CodeBadSegment: "bad_segment", cq.CodeRemoteRange: "remote_range", cq.CodeLength: "length", cq.CodeTimeout: "timeout",
	cq.CodeCanceled: "canceled", cq.CodeTransport: "transport", cq.CodeDenied: "denied", cq.CodeClosed: "closed",
	cq.CodeNoTransport: "no_transport", cq.CodeQueueFull: "queue_full", cq.CodeTransportDown: "transport_down",
}

// codeName is the name of code in FailedBy: "transport", "denied", ...;
// "code_N" for a code this build does not know.
func codeName(code moonring.Code) string {
	if n, ok := codeNames[code]; ok {
		return n
	}
	return fmt.Sprintf("code_%d", code)
}

// endings is what one goroutine of a step keeps of its requests' ends:
// their counts, whether the last request on each block (slot) did not
// complete, and the first that did not. Without keepGoing that first one
// ends the goroutine's work; with it, the work goes on.
type endings struct {
	keepGoing bool
	counts    statusCounts
	// failed is indexed by slot and shared by the step's goroutines, each
	// touching only its own slots; nil when nobody asks.
	failed []bool
	first  error
}

// ended counts a request on slot that ended with st and code. It returns
// the request's error when it did not complete and the goroutine must
// stop (no keepGoing); nil otherwise.
func (o *endings) ended(slot int, st moonring.Status, code moonring.Code) error {
	o.counts.ended(st, code)
	ok := st == moonring.COMPLETED
	if o.failed != nil {
		o.failed[slot] = !ok
	}
	if ok {
		return nil
	}
	err := fmt.Errorf("%s: %w", st, code.Err())
	if o.first == nil {
		o.first = err
	}
	if o.keepGoing {
		return nil
	}
	return err
}

// note keeps err as the first failure unless one is kept already (or err
// is nil).
func (o *endings) note(err error) {
	if o.first == nil {
		o.first = err
	}
}

// requestsError is the error of a step under --keep-going whose requests
// did not all complete: it ran to its end, and its row was printed.
type requestsError struct {
	counts statusCounts
	first  error // the first that did not complete, explained (target.stepError)
}

func (e *requestsError) Error() string {
	return fmt.Sprintf("%d of %d requests did not complete (%s); the first: %v", e.counts.notCompleted(), e.counts.Submitted, e.counts, e.first)
}

func (e *requestsError) Unwrap() error { return e.first }
