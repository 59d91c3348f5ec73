//go:build amd64 && !race && !msan && !asan

#include "textflag.h"

// func moveString(dst, src unsafe.Pointer, n uintptr)
TEXT ·moveString(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	REP; MOVSB
	RET

// func move512(dst, src unsafe.Pointer, n uintptr)
TEXT ·move512(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	// The last 64 bytes, first: the loops below stop short of them.
	VMOVDQU64 -64(SI)(CX*1), Z4
	VMOVDQU64 Z4, -64(DI)(CX*1)
	CMPQ CX, $256
	JB   tail
big:
	VMOVDQU64 0(SI), Z0
	VMOVDQU64 64(SI), Z1
	VMOVDQU64 128(SI), Z2
	VMOVDQU64 192(SI), Z3
	VMOVDQU64 Z0, 0(DI)
	VMOVDQU64 Z1, 64(DI)
	VMOVDQU64 Z2, 128(DI)
	VMOVDQU64 Z3, 192(DI)
	ADDQ $256, SI
	ADDQ $256, DI
	SUBQ $256, CX
	CMPQ CX, $256
	JAE  big
tail:
	CMPQ CX, $64
	JBE  done
	VMOVDQU64 0(SI), Z0
	VMOVDQU64 Z0, 0(DI)
	ADDQ $64, SI
	ADDQ $64, DI
	SUBQ $64, CX
	JMP  tail
done:
	VZEROUPPER
	RET

// func prefetch(dst, src unsafe.Pointer, n uintptr, write bool)
// n > 0. Prefetches never fault, whatever the address.
TEXT ·prefetch(SB), NOSPLIT, $0-25
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	MOVBLZX write+24(FP), AX
	TESTQ AX, AX
	JZ   read
both:
	PREFETCHT0 0(SI)
	BYTE $0x0F; BYTE $0x0D; BYTE $0x0F // PREFETCHW (DI): for the store to come
	ADDQ $64, SI
	ADDQ $64, DI
	SUBQ $64, CX
	JA   both
	RET
read:
	PREFETCHT0 0(SI)
	PREFETCHT0 0(DI)
	ADDQ $64, SI
	ADDQ $64, DI
	SUBQ $64, CX
	JA   read
	RET

// func cpuidLeaf(leaf uint32) (eax, ecx uint32)
TEXT ·cpuidLeaf(SB), NOSPLIT, $0-16
	MOVL leaf+0(FP), AX
	XORL CX, CX
	CPUID
	MOVL AX, eax+8(FP)
	MOVL CX, ecx+12(FP)
	RET
