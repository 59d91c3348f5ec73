module github.com/moonring/moonring

go 1.26.8

require (
	github.com/klauspost/cpuid/v2 v2.4.2 // indirect
	github.com/leanovate/gopter v0.2.11 // indirect
	go.uber.org/goleak v1.3.0 // indirect
	golang.org/x/sys v0.50.0 // indirect
)
