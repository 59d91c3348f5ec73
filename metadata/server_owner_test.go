package metadata_test

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/moonring/moonring/metadata"
	"github.com/moonring/moonring/segtable"
)

// token computes the owner token of name under key as Server's doc
// defines it, independently of the package.
func token(key, name string) string {
	m := hmac.New(sha256.New, []byte(key))
	m.Write([]byte("moonring metadata owner v1"))
	m = hmac.New(sha256.New, m.Sum(nil))
	m.Write([]byte(name))
	return base64.RawURLEncoding.EncodeToString(m.Sum(nil))
}

// served returns the descriptor s serves under name and its ETag, or nil.
func served(t *testing.T, s http.Handler, name string) (*segtable.SegmentDesc, string) {
	t.Helper()
	w := request(t, s, "GET", seg+name, nil)
	if w.Code != 200 {
		return nil, ""
	}
	d, err := segtable.UnmarshalDesc(w.Body.Bytes())
	if err != nil {
		t.Fatal(err)
	}
	return d, w.Header().Get("ETag")
}

// attempts are the changes an attacker tries on name "a", held by epoch 7
// with tag "owner": with the header given (none, a wrong token, garbage),
// a replacement of the same epoch pointing elsewhere, a renewal, a delete,
// and a delete followed by a PUT of another epoch.
func attack(t *testing.T, s http.Handler, header []string, code int) {
	t.Helper()
	forged := marshalSigned(t, testDesc("a", 7, "relay"))
	for _, tc := range []struct {
		what, method, path string
		body               []byte
		header             []string
	}{
		{"replace", "PUT", seg + "a", forged, header},
		{"renew", "PUT", seg + "a", forged, append([]string{"Moonring-Renew", "1", "Moonring-TTL", "600"}, header...)},
		{"delete", "DELETE", seg + "a", nil, header},
		{"delete epoch", "DELETE", seg + "a?epoch=7", nil, header},
		{"take over", "PUT", seg + "a", marshalSigned(t, testDesc("a", 8, "relay")), header},
	} {
		before, etag := served(t, s, "a")
		w := request(t, s, tc.method, tc.path, tc.body, tc.header...)
		if w.Code != code {
			t.Errorf("%s with %q: %d %q, want %d", tc.what, header, w.Code, w.Body, code)
		}
		if code == 401 && w.Header().Get("WWW-Authenticate") != "Moonring-Owner" {
			t.Errorf("401 without WWW-Authenticate: %v", w.Header())
		}
		after, etag2 := served(t, s, "a")
		if after == nil || after.Epoch != before.Epoch || after.Endpoints["tcp"] != "owner" || etag2 != etag {
			t.Fatalf("%s with %q changed the entry: %+v %s, was %+v %s", tc.what, header, after, etag2, before, etag)
		}
	}
}

// A server with the key refuses every change without the token its key
// derives for the name: none (401), another key's, another name's or a
// malformed one (403); nothing changes, nobody can squat a free name, and
// the owner's own changes go through.
func TestServerOwnerKey(t *testing.T) {
	s := newServer(t, metadata.ServerConfig{Key: []byte("k")})
	good := token("k", "a")
	// Squatting a free name.
	for _, h := range [][]string{nil, {"Moonring-Owner", token("other key", "a")}} {
		if w := request(t, s, "PUT", seg+"a", marshalSigned(t, testDesc("a", 1, "squat")), h...); w.Code == 204 {
			t.Fatalf("PUT of a free name with %q stored it", h)
		}
		if d, _ := served(t, s, "a"); d != nil {
			t.Fatalf("a refused PUT stored %+v", d)
		}
	}
	if w := request(t, s, "PUT", seg+"a", marshalSigned(t, testDesc("a", 7, "owner")), "Moonring-Owner", good); w.Code != 204 {
		t.Fatalf("owner's PUT: %d %s", w.Code, w.Body)
	}
	attack(t, s, nil, 401)
	for _, bad := range []string{token("other key", "a"), token("deployment key", "b"), "not a token", good[:42], good + "A", strings.ToUpper(good)} {
		attack(t, s, []string{"Moonring-Owner", bad}, 403)
	}
	st := s.Stats()
	if st.Unauthenticated != 1+5 || st.Forbidden != 1+6*5 || st.Names != 1 {
		t.Fatalf("Stats %+v, want 6 unauthenticated and 31 forbidden", st)
	}
	// Two headers, one of them right, are no proof.
	r := httptest.NewRequestWithContext(t.Context(), "DELETE", seg+"a", nil)
	r.Header.Add("Moonring-Owner", "x")
	r.Header.Add("Moonring-Owner", good)
	w := httptest.NewRecorder()
	s.ServeHTTP(w, r)
	if w.Code != 403 {
		t.Fatalf("DELETE with two tokens: %d", w.Code)
	}
	// The owner republishes, renews and deletes.
	if w := request(t, s, "PUT", seg+"a", marshalSigned(t, testDesc("a", 7, "owner")), "Moonring-Owner", good, "Moonring-Renew", "1"); w.Code != 204 {
		t.Fatalf("owner's renewal: %d %s", w.Code, w.Body)
	}
	if w := request(t, s, "DELETE", seg+"a?epoch=7", nil, "Moonring-Owner", good); w.Code != 204 {
		t.Fatalf("owner's DELETE: %d %s", w.Code, w.Body)
	}
	// Reads need nothing.
	if w := request(t, s, "GET", seg+"a", nil); w.Code != 404 {
		t.Fatalf("GET after DELETE: %d", w.Code)
	}
}

// A server without the key binds a name to the token that created it: a
// change without it (401) or with another (403) is refused, until the
// binding goes with the entry. A name created without a token stays open
// (what clients without a key need), unless RequireOwner.
func TestServerOwnerBinding(t *testing.T) {
	s := newServer(t, metadata.ServerConfig{})
	owner := token("owner key", "a")
	if w := request(t, s, "PUT", seg+"a", marshalSigned(t, testDesc("a", 7, "owner")), "Moonring-Owner", owner); w.Code != 204 {
		t.Fatalf("owner's PUT: %d %s", w.Code, w.Body)
	}
	attack(t, s, nil, 401)
	attack(t, s, []string{"Moonring-Owner", token("attacker key", "a")}, 403)
	attack(t, s, []string{"Moonring-Owner", "garbage"}, 403)
	if w := request(t, s, "PUT", seg+"a", marshalSigned(t, testDesc("a", 7, "owner")), "Moonring-Owner", owner, "Moonring-Renew", "1"); w.Code != 204 {
		t.Fatalf("owner's renewal: %d %s", w.Code, w.Body)
	}
	if w := request(t, s, "DELETE", seg+"a", nil, "Moonring-Owner", owner); w.Code != 204 {
		t.Fatalf("owner's DELETE: %d %s", w.Code, w.Body)
	}
	// The binding went with the entry: the name is free for anyone.
	if w := request(t, s, "PUT", seg+"a", marshalSigned(t, testDesc("a", 9, "next")), "Moonring-Owner", token("next key", "a")); w.Code != 204 {
		t.Fatalf("PUT of a deleted name: %d %s", w.Code, w.Body)
	}

	// Unbound: open to anyone, until a change with a token binds it.
	if w := request(t, s, "PUT", seg+"u", marshalSigned(t, testDesc("u", 1, "x"))); w.Code != 204 {
		t.Fatalf("PUT without a token: %d %s", w.Code, w.Body)
	}
	if w := request(t, s, "PUT", seg+"u", marshalSigned(t, testDesc("u", 1, "y"))); w.Code != 204 {
		t.Fatalf("replacement of an unbound name: %d %s", w.Code, w.Body)
	}
	if w := request(t, s, "PUT", seg+"u", marshalSigned(t, testDesc("u", 1, "y")), "Moonring-Renew", "1", "Moonring-Owner", token("k", "u")); w.Code != 204 {
		t.Fatalf("renewal with a token: %d %s", w.Code, w.Body)
	}
	if w := request(t, s, "DELETE", seg+"u", nil); w.Code != 401 {
		t.Fatalf("DELETE without a token of a name a renewal bound: %d", w.Code)
	}

	r := newServer(t, metadata.ServerConfig{RequireOwner: true})
	if w := request(t, r, "PUT", seg+"u", marshalSigned(t, testDesc("u", 1, "x"))); w.Code != 401 {
		t.Fatalf("RequireOwner: PUT without a token: %d", w.Code)
	}
	if w := request(t, r, "PUT", seg+"u", marshalSigned(t, testDesc("u", 1, "x")), "Moonring-Owner", token("k", "u")); w.Code != 204 {
		t.Fatalf("RequireOwner: PUT with a token: %d", w.Code)
	}
}

// An attacker who renews an entry it cannot change does not keep it alive:
// the time to live runs out as if it had not tried.
func TestServerOwnerRenewalRefused(t *testing.T) {
	s := newServer(t, metadata.ServerConfig{Key: []byte("k")})
	body := marshalSigned(t, testDesc("a", 7, "owner"))
	if w := request(t, s, "PUT", seg+"a", body, "Moonring-Owner", token("k", "a"), "Moonring-TTL", "0.2"); w.Code != 204 {
		t.Fatalf("PUT: %d %s", w.Code, w.Body)
	}
	deadline := time.Now().Add(hang)
	for request(t, s, "GET", seg+"a", nil).Code != 404 {
		if time.Now().After(deadline) {
			t.Fatalf("entry with a TTL of 200ms still there after %v of refused renewals", hang)
		}
		request(t, s, "PUT", seg+"a", body, "Moonring-Renew", "1", "Moonring-TTL", "600")
		request(t, s, "PUT", seg+"a", body, "Moonring-Renew", "1", "Moonring-TTL", "600", "Moonring-Owner", token("x", "a"))
		time.Sleep(10 * time.Millisecond)
	}
}

// The owner binding is kept in the directory: a restarted server without
// the key still refuses a stranger's change of a bound name.
func TestServerOwnerPersisted(t *testing.T) {
	dir := t.TempDir()
	s := newServer(t, metadata.ServerConfig{Dir: dir})
	if w := request(t, s, "PUT", seg+"a", marshalSigned(t, testDesc("a", 7, "owner")), "Moonring-Owner", token("k", "a")); w.Code != 204 {
		t.Fatalf("PUT: %d %s", w.Code, w.Body)
	}
	s.Close()
	s = newServer(t, metadata.ServerConfig{Dir: dir})
	attack(t, s, nil, 401)
	attack(t, s, []string{"Moonring-Owner", token("x", "a")}, 403)
	if w := request(t, s, "DELETE", seg+"a", nil, "Moonring-Owner", token("k", "a")); w.Code != 204 {
		t.Fatalf("owner's DELETE after the restart: %d %s", w.Code, w.Body)
	}

	// A name a stranger bound while the server had no key: once the
	// server has the key, the key's owner renews it and the binding is
	// the key's, also after a restart without the key.
	if w := request(t, s, "PUT", seg+"a", marshalSigned(t, testDesc("a", 7, "owner")), "Moonring-Owner", token("stranger", "a")); w.Code != 204 {
		t.Fatalf("stranger's PUT: %d %s", w.Code, w.Body)
	}
	s.Close()
	s = newServer(t, metadata.ServerConfig{Dir: dir, Key: []byte("k")})
	if w := request(t, s, "PUT", seg+"a", marshalSigned(t, testDesc("a", 7, "owner")), "Moonring-Owner", token("k", "a"), "Moonring-Renew", "1"); w.Code != 204 {
		t.Fatalf("the key's renewal: %d %s", w.Code, w.Body)
	}
	s.Close()
	s = newServer(t, metadata.ServerConfig{Dir: dir})
	attack(t, s, []string{"Moonring-Owner", token("stranger", "a")}, 403)
	if w := request(t, s, "DELETE", seg+"a", nil, "Moonring-Owner", token("k", "a")); w.Code != 204 {
		t.Fatalf("the key's DELETE: %d %s", w.Code, w.Body)
	}
}
