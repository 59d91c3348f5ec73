package metadata

import (
	"crypto/hmac"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"net/http"
	"strconv"

	"github.com/moonring/moonring/segtable"
)

// Owner tokens: the proof that a change of a name on a metadata server
// ([Server]) comes from a holder of the deployment's segment key.
//
//	ownerKey = HMAC-SHA256(key, "moonring metadata owner v1")
//	token    = HMAC-SHA256(ownerKey, name)
//
// sent base64url-encoded without padding (43 characters) in the header
// Moonring-Owner of every PUT and DELETE. A server given the key computes
// the token itself; a server without it keeps only the SHA-256 of the
// token that created a name.
const (
	// headerOwner carries the owner token of a PUT or DELETE.
	headerOwner = "Moonring-Owner"
	// ownerContext separates owner tokens from every other use of the
	// segment key.
	ownerContext = "moonring metadata owner v1"
	// ownerTokenLen is the length of a token, an HMAC-SHA256.
	ownerTokenLen = sha256.Size
)

// newOwnerKey returns the key that owner tokens are derived from, or nil
// without a segment key.
func newOwnerKey(key []byte) []byte {
	if len(key) == 0 {
		return nil
	}
	m := hmac.New(sha256.New, key)
	m.Write([]byte(ownerContext))
	return m.Sum(nil)
}

// newSigner returns the checker of descriptors' signatures under key, nil
// without a key.
func newSigner(key []byte) *segtable.Signer {
	if len(key) == 0 {
		return nil
	}
	s, _ := segtable.NewSigner(key) // fails only on an empty key
	return s
}

// ownerToken returns the owner token of name under ownerKey.
func ownerToken(ownerKey []byte, name string) []byte {
	m := hmac.New(sha256.New, ownerKey)
	m.Write([]byte(name))
	return m.Sum(nil)
}

// encodeToken returns a token as it travels in the header.
func encodeToken(tok []byte) string { return base64.RawURLEncoding.EncodeToString(tok) }

// requestToken reads the owner token of r: present reports whether the
// header was sent, and tok is nil when what was sent is not a token.
func requestToken(r *http.Request) (tok []byte, present bool) {
	vs := r.Header.Values(headerOwner)
	if len(vs) == 0 {
		return nil, false
	}
	if len(vs) != 1 || len(vs[0]) != base64.RawURLEncoding.EncodedLen(ownerTokenLen) {
		return nil, true
	}
	tok, err := base64.RawURLEncoding.DecodeString(vs[0])
	if err != nil || len(tok) != ownerTokenLen {
		return nil, true
	}
	return tok, true
}

// ownerHash is what a server keeps of a token: its SHA-256, so that its
// memory and its directory never hold a credential.
type ownerHash [sha256.Size]byte

func hashToken(tok []byte) ownerHash { return sha256.Sum256(tok) }

// equal compares in constant time.
func (h *ownerHash) equal(o *ownerHash) bool { return subtle.ConstantTimeCompare(h[:], o[:]) == 1 }

// refusal is why a change of a name is refused: an HTTP status (401 or
// 403) and the message; the zero value allows it.
type refusal struct {
	code int
	msg  string
}

// authorize decides whether a request carrying tok (present: whether it
// sent the header at all) may change name, which holds e (nil when it holds
// nothing). It reads only e.owner and e.bound, under s.mu or with e not
// yet shared; e may be nil.
func (s *Server) authorize(name string, tok []byte, present bool, e *serverEntry) refusal {
	bound := e != nil && e.bound
	if !present {
		switch {
		case s.ownerKey != nil:
			return refusal{http.StatusUnauthorized, "this server needs the owner token of the segment key (" + headerOwner + ")"}
		case bound:
			return refusal{http.StatusUnauthorized, "segment " + quote(name) + " is bound to an owner token (" + headerOwner + ")"}
		case e == nil && s.requireOwner:
			return refusal{http.StatusUnauthorized, "this server needs an owner token (" + headerOwner + ")"}
		}
		return refusal{}
	}
	if tok == nil {
		return refusal{http.StatusForbidden, "malformed " + headerOwner + " header"}
	}
	if s.ownerKey != nil {
		if !hmac.Equal(tok, ownerToken(s.ownerKey, name)) {
			return refusal{http.StatusForbidden, "owner token not of this deployment's key for segment " + quote(name)}
		}
		return refusal{}
	}
	if bound {
		h := hashToken(tok)
		if !h.equal(&e.owner) {
			return refusal{http.StatusForbidden, "segment " + quote(name) + " is bound to another owner token"}
		}
	}
	return refusal{}
}

func quote(s string) string { return strconv.Quote(s) }
