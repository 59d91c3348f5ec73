package etcd

import "google.golang.org/grpc"

// NewIntercepted is New with i in the chain of the client's unary
// interceptors, inside the client's own: what i returns, the store takes
// for etcd's answer (the tests fail requests as etcd does).
func NewIntercepted(cfg Config, i grpc.UnaryClientInterceptor) (*Store, error) {
	return newStore(cfg, grpc.WithChainUnaryInterceptor(i))
}
