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

// func prefetch(dst, src unsafe.Pointer, n uintptr, mode uint8)
// n > 0. Prefetches never fault, whatever the address. mode: prefSrc
// (0), the source only; prefRead (1), the destination too with
// PREFETCHT0; prefWrite (2), the destination with PREFETCHW.
TEXT ·prefetch(SB), NOSPLIT, $0-25
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	MOVBLZX mode+24(FP), AX
	CMPQ AX, $1
	JB   srconly
	JE   read
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
srconly:
	PREFETCHT0 0(SI)
	ADDQ $64, SI
	SUBQ $64, CX
	JA   srconly
	RET

// func cpuidLeaf(leaf uint32) (eax, ecx uint32)
TEXT ·cpuidLeaf(SB), NOSPLIT, $0-16
	MOVL leaf+0(FP), AX
	XORL CX, CX
	CPUID
	MOVL AX, eax+8(FP)
	MOVL CX, ecx+12(FP)
	RET

// func moveStream(dst, src unsafe.Pointer, n uintptr)
// n >= 128. Non-temporal 32-byte AVX2 stores to dst from its first
// 64-byte boundary, the bytes before it and the last 64 with plain
// stores (overlapping bytes get the same values twice), and a prefetch of
// the source streamDist ahead while that is inside it; SFENCE at the end.
TEXT ·moveStream(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	// The first and the last 64 bytes, plain.
	VMOVDQU 0(SI), Y0
	VMOVDQU 32(SI), Y1
	VMOVDQU -64(SI)(CX*1), Y2
	VMOVDQU -32(SI)(CX*1), Y3
	VMOVDQU Y0, 0(DI)
	VMOVDQU Y1, 32(DI)
	VMOVDQU Y2, -64(DI)(CX*1)
	VMOVDQU Y3, -32(DI)(CX*1)
	// On to dst's next 64-byte boundary (64 on when it is on one).
	MOVQ DI, AX
	ANDQ $63, AX
	MOVQ $64, DX
	SUBQ AX, DX
	ADDQ DX, DI
	ADDQ DX, SI
	SUBQ DX, CX
	CMPQ CX, $4352 // streamDist + 256
	JB   near
ahead:
	PREFETCHT0 4096(SI)
	PREFETCHT0 4160(SI)
	PREFETCHT0 4224(SI)
	PREFETCHT0 4288(SI)
	VMOVDQU 0(SI), Y0
	VMOVDQU 32(SI), Y1
	VMOVDQU 64(SI), Y2
	VMOVDQU 96(SI), Y3
	VMOVDQU 128(SI), Y4
	VMOVDQU 160(SI), Y5
	VMOVDQU 192(SI), Y6
	VMOVDQU 224(SI), Y7
	VMOVNTDQ Y0, 0(DI)
	VMOVNTDQ Y1, 32(DI)
	VMOVNTDQ Y2, 64(DI)
	VMOVNTDQ Y3, 96(DI)
	VMOVNTDQ Y4, 128(DI)
	VMOVNTDQ Y5, 160(DI)
	VMOVNTDQ Y6, 192(DI)
	VMOVNTDQ Y7, 224(DI)
	ADDQ $256, SI
	ADDQ $256, DI
	SUBQ $256, CX
	CMPQ CX, $4352
	JAE  ahead
near:
	CMPQ CX, $64
	JB   end
	VMOVDQU 0(SI), Y0
	VMOVDQU 32(SI), Y1
	VMOVNTDQ Y0, 0(DI)
	VMOVNTDQ Y1, 32(DI)
	ADDQ $64, SI
	ADDQ $64, DI
	SUBQ $64, CX
	JMP  near
end:
	SFENCE
	VZEROUPPER
	RET

// func movePair(d1, s1, d2, s2 unsafe.Pointer, n uintptr)
// n > 0, a multiple of 128; d1 and d2 on 64-byte boundaries. Two copies of
// n bytes at once, 128 bytes of each a round: 32-byte AVX2 loads,
// non-temporal stores, both sources prefetched streamDist ahead while
// that is inside them; SFENCE at the end.
TEXT ·movePair(SB), NOSPLIT, $0-40
	MOVQ d1+0(FP), DI
	MOVQ s1+8(FP), SI
	MOVQ d2+16(FP), R8
	MOVQ s2+24(FP), R9
	MOVQ n+32(FP), CX
pair:
	CMPQ CX, $4224 // streamDist + 128
	JB   pairnear
	PREFETCHT0 4096(SI)
	PREFETCHT0 4160(SI)
	PREFETCHT0 4096(R9)
	PREFETCHT0 4160(R9)
pairnear:
	VMOVDQU 0(SI), Y0
	VMOVDQU 32(SI), Y1
	VMOVDQU 64(SI), Y2
	VMOVDQU 96(SI), Y3
	VMOVDQU 0(R9), Y4
	VMOVDQU 32(R9), Y5
	VMOVDQU 64(R9), Y6
	VMOVDQU 96(R9), Y7
	VMOVNTDQ Y0, 0(DI)
	VMOVNTDQ Y1, 32(DI)
	VMOVNTDQ Y2, 64(DI)
	VMOVNTDQ Y3, 96(DI)
	VMOVNTDQ Y4, 0(R8)
	VMOVNTDQ Y5, 32(R8)
	VMOVNTDQ Y6, 64(R8)
	VMOVNTDQ Y7, 96(R8)
	ADDQ $128, SI
	ADDQ $128, DI
	ADDQ $128, R8
	ADDQ $128, R9
	SUBQ $128, CX
	JNZ  pair
	SFENCE
	VZEROUPPER
	RET

// func moveQuad(d, s *[4]unsafe.Pointer, n uintptr)
// n > 0, a multiple of 128; each d[i] on a 64-byte boundary. Four copies
// of n bytes at once, s[i] to d[i], 128 bytes of each a round (all sixteen
// Y registers): 32-byte AVX2 loads, non-temporal stores, each source
// prefetched streamDist ahead while that is inside it; SFENCE at the end.
TEXT ·moveQuad(SB), NOSPLIT, $0-24
	MOVQ d+0(FP), AX
	MOVQ s+8(FP), BX
	MOVQ 0(AX), DI
	MOVQ 8(AX), R8
	MOVQ 16(AX), R10
	MOVQ 24(AX), R12
	MOVQ 0(BX), SI
	MOVQ 8(BX), R9
	MOVQ 16(BX), R11
	MOVQ 24(BX), R13
	MOVQ n+16(FP), CX
quad:
	CMPQ CX, $4224 // streamDist + 128
	JB   quadnear
	PREFETCHT0 4096(SI)
	PREFETCHT0 4160(SI)
	PREFETCHT0 4096(R9)
	PREFETCHT0 4160(R9)
	PREFETCHT0 4096(R11)
	PREFETCHT0 4160(R11)
	PREFETCHT0 4096(R13)
	PREFETCHT0 4160(R13)
quadnear:
	VMOVDQU 0(SI), Y0
	VMOVDQU 32(SI), Y1
	VMOVDQU 64(SI), Y2
	VMOVDQU 96(SI), Y3
	VMOVDQU 0(R9), Y4
	VMOVDQU 32(R9), Y5
	VMOVDQU 64(R9), Y6
	VMOVDQU 96(R9), Y7
	VMOVDQU 0(R11), Y8
	VMOVDQU 32(R11), Y9
	VMOVDQU 64(R11), Y10
	VMOVDQU 96(R11), Y11
	VMOVDQU 0(R13), Y12
	VMOVDQU 32(R13), Y13
	VMOVDQU 64(R13), Y14
	VMOVDQU 96(R13), Y15
	VMOVNTDQ Y0, 0(DI)
	VMOVNTDQ Y1, 32(DI)
	VMOVNTDQ Y2, 64(DI)
	VMOVNTDQ Y3, 96(DI)
	VMOVNTDQ Y4, 0(R8)
	VMOVNTDQ Y5, 32(R8)
	VMOVNTDQ Y6, 64(R8)
	VMOVNTDQ Y7, 96(R8)
	VMOVNTDQ Y8, 0(R10)
	VMOVNTDQ Y9, 32(R10)
	VMOVNTDQ Y10, 64(R10)
	VMOVNTDQ Y11, 96(R10)
	VMOVNTDQ Y12, 0(R12)
	VMOVNTDQ Y13, 32(R12)
	VMOVNTDQ Y14, 64(R12)
	VMOVNTDQ Y15, 96(R12)
	ADDQ $128, SI
	ADDQ $128, DI
	ADDQ $128, R8
	ADDQ $128, R9
	ADDQ $128, R10
	ADDQ $128, R11
	ADDQ $128, R12
	ADDQ $128, R13
	SUBQ $128, CX
	JNZ  quad
	SFENCE
	VZEROUPPER
	RET
