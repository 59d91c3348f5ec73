// transfer.go holds the batch of transfers of the KV workload and its
// checks: one batch through the batch API, each transfer's end counted and
// its status handed back, so that a caller under --keep-going can tell
// which of its transfers moved their bytes.

package main

import (
	"context"
	"fmt"

	"github.com/moonring/moonring"
)

// transfer runs reqs as one batch (AllocateBatchID, SubmitTransfer,
// WaitBatch), counts each request's end in c and returns their statuses.
// When ctx ends first, the requests are canceled and waited for (and
// counted), and the error says so. A batch that cannot be allocated or
// submitted is an error, and nothing of it is counted.
func transfer(ctx context.Context, e *moonring.Engine, reqs []moonring.TransferRequest, c *statusCounts) ([]moonring.TransferStatus, error) {
	id, err := e.AllocateBatchID(len(reqs))
	if err != nil {
		return nil, err
	}
	defer e.FreeBatchID(id)
	if err := e.SubmitTransfer(id, reqs); err != nil {
		e.WaitBatch(context.Background(), id)
		return nil, err
	}
	c.submitted(len(reqs))
	werr := e.WaitBatch(ctx, id)
	if werr != nil {
		for i := range reqs {
			e.CancelTransfer(id, i)
		}
		e.WaitBatch(context.Background(), id)
	}
	sts := make([]moonring.TransferStatus, len(reqs))
	n, err := e.GetBatchTransferStatus(id, sts)
	if err != nil {
		return nil, err
	}
	for _, st := range sts[:n] {
		c.ended(st.Status, st.Code)
	}
	if werr != nil {
		if ff := firstFailure(sts); ff != nil {
			return sts, fmt.Errorf("%w (%w)", ff, werr)
		}
		return sts, werr
	}
	return sts, nil
}

// firstFailure is the error of the first of sts that ended without
// completing, worded as Engine.Transfer words it; nil when none did (a
// status that is not terminal is one never submitted: ringMove stops
// submitting at a failure).
func firstFailure(sts []moonring.TransferStatus) error {
	for i, st := range sts {
		if st.Status.Terminal() && st.Status != moonring.COMPLETED {
			return fmt.Errorf("moonring: transfer %d: %s: %w", i, st.Status, st.Err())
		}
	}
	return nil
}
