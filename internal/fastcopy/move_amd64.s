//go:build amd64 && !race

#include "textflag.h"

// func move(dst, src unsafe.Pointer, n uintptr)
TEXT ·move(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	REP; MOVSB
	RET
