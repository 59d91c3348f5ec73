package mooncake

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
)

// fakeServer is a Mooncake HTTP metadata server written from the protocol
// (see FORMATS.md): one path, the key in the query, raw bodies kept as
// they came. strict selects the behaviour of the server in mooncake_master
// (400 without a key, 404 for a DELETE of nothing, an rpc_meta key written
// once: the same body again is 200, another 400); without it, that of the
// example Go server (any key, DELETE always 200, rpc_meta overwritten).
type fakeServer struct {
	*httptest.Server
	strict bool

	mu   sync.Mutex
	kv   map[string][]byte
	reqs int
}

func newFakeServer(t testing.TB, strict bool) *fakeServer {
	f := &fakeServer{strict: strict, kv: map[string][]byte{}}
	mux := http.NewServeMux()
	mux.HandleFunc("/metadata", f.handle)
	f.Server = httptest.NewServer(mux)
	t.Cleanup(f.Close)
	return f
}

// URL returns the endpoint URL an engine is given.
func (f *fakeServer) url() string { return f.Server.URL + "/metadata" }

func reply(w http.ResponseWriter, code int, msg string) {
	w.Header().Set("Content-Type", "application/json; charset=utf-8")
	w.WriteHeader(code)
	io.WriteString(w, msg)
}

func (f *fakeServer) handle(w http.ResponseWriter, r *http.Request) {
	key := r.URL.Query().Get("key")
	f.mu.Lock()
	defer f.mu.Unlock()
	f.reqs++
	if key == "" && f.strict {
		reply(w, http.StatusBadRequest, "Missing key parameter")
		return
	}
	switch r.Method {
	case http.MethodGet:
		v, ok := f.kv[key]
		if !ok {
			reply(w, http.StatusNotFound, "metadata not found")
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Write(v)
	case http.MethodPut:
		body, err := io.ReadAll(r.Body)
		if err != nil {
			reply(w, http.StatusBadRequest, "invalid request")
			return
		}
		if old, ok := f.kv[key]; ok && f.strict && strings.Contains(key, "rpc_meta") {
			if string(old) == string(body) {
				reply(w, http.StatusOK, "metadata unchanged")
			} else {
				reply(w, http.StatusBadRequest, "Duplicate rpc_meta key not allowed")
			}
			return
		}
		f.kv[key] = body
		reply(w, http.StatusOK, "metadata updated")
	case http.MethodDelete:
		if _, ok := f.kv[key]; !ok && f.strict {
			reply(w, http.StatusNotFound, "metadata not found")
			return
		}
		delete(f.kv, key)
		reply(w, http.StatusOK, "metadata deleted")
	default:
		reply(w, http.StatusMethodNotAllowed, "Method not allowed")
	}
}

func (f *fakeServer) get(key string) ([]byte, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	v, ok := f.kv[key]
	return v, ok
}

func (f *fakeServer) set(key string, v []byte) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.kv[key] = v
}

func (f *fakeServer) keys() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var ks []string
	for k := range f.kv {
		ks = append(ks, k)
	}
	return ks
}
