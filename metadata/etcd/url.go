package etcd

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"strconv"
	"strings"
)

// etcdMaxFile bounds what ParseURL reads of a password file: a
// password, not a document; a name that points at a device is not read
// for ever.
const etcdMaxFile = 4 << 10

// etcdMaxPEM bounds a CA bundle, certificate or key file.
const etcdMaxPEM = 1 << 20

// ParseURL parses the etcd:// form of a metadata store, as the
// --metadata flag of `moonring serve` and `moonring bench` takes it, into
// an [Config] for [New]:
//
//	etcd://HOST:PORT[,HOST:PORT...][?PARAM=VALUE&...]
//
// with the parameters, each at most once:
//
//   - cacert=FILE: the PEM bundle of the CA(s) that signed etcd's server
//     certificates (default: the system's roots); implies TLS.
//   - cert=FILE and key=FILE, together: the client certificate and its
//     key (PEM) for an etcd that requires them (--client-cert-auth);
//     imply TLS.
//   - tls=1: TLS with the system's roots and no client certificate.
//   - user=NAME and password-file=FILE, together: the etcd user to
//     authenticate as (etcd's auth) and its password, the file's content
//     with one trailing newline removed; the file must be a regular file
//     that neither its group nor others may read (mode 0600 or 0400). A
//     password is never taken from the URL itself: command lines are
//     visible to every user of the host.
//   - layout=flat or layout=chunks: how Put writes an engine's descriptor
//     (Config.FlatLayout): whole under one key, for readers older than the
//     per-chunk layout, or, the default, a header and a key per chunk.
//
// Values are URL query values (a path with '&', '=' or '%' must be
// escaped). With TLS the endpoints become https://HOST:PORT, else
// http://HOST:PORT. Without TLS a password travels to etcd in the clear.
// ParseURL reads the files it names (so that a missing or unreadable
// one is reported at once, naming the file) and keeps no reference to
// them; Prefix, TTL and DialTimeout of the result are zero (their
// defaults). It is safe for concurrent use.
func ParseURL(s string) (Config, error) {
	var cfg Config
	// Errors name the hosts, never the parameters, which may hold a
	// secret put there by mistake.
	what, _, _ := strings.Cut(s, "?")
	fail := func(format string, args ...any) (Config, error) {
		return Config{}, fmt.Errorf("metadata etcd: %q: %s", what, fmt.Sprintf(format, args...))
	}
	rest, ok := strings.CutPrefix(s, "etcd://")
	if !ok {
		return fail("want etcd://HOST:PORT[,HOST:PORT...][?PARAMS]")
	}
	hosts, query, _ := strings.Cut(rest, "?")
	if strings.ContainsAny(hosts, "/#@") {
		return fail("want no path, fragment or user in the hosts (user=NAME is a parameter)")
	}
	q, err := url.ParseQuery(query)
	if err != nil {
		return fail("bad parameters: %v", err)
	}
	param := func(k string) string { return q.Get(k) }
	for k, vs := range q {
		switch k {
		case "cacert", "cert", "key", "tls", "user", "password-file", "layout":
		default:
			return fail("unknown parameter %q (want cacert, cert, key, tls, user, password-file, layout)", k)
		}
		if len(vs) != 1 || vs[0] == "" {
			return fail("parameter %q wants one non-empty value", k)
		}
	}
	switch v := param("layout"); v {
	case "", "chunks":
	case "flat":
		cfg.FlatLayout = true
	default:
		return fail("layout=%q: want flat or chunks", v)
	}
	useTLS := false
	if v := param("tls"); v != "" {
		if useTLS, err = strconv.ParseBool(v); err != nil {
			return fail("tls=%q is not a boolean", v)
		}
	}
	if param("cacert") != "" || param("cert") != "" || param("key") != "" {
		if q.Has("tls") && !useTLS {
			return fail("tls=%s with certificates", param("tls"))
		}
		useTLS = true
	}
	if useTLS {
		cfg.TLS = &tls.Config{MinVersion: tls.VersionTLS12}
		if f := param("cacert"); f != "" {
			b, err := readBounded(f, etcdMaxPEM, false)
			if err != nil {
				return fail("cacert: %v", err)
			}
			pool := x509.NewCertPool()
			if !pool.AppendCertsFromPEM(b) {
				return fail("cacert: no PEM certificate in %s", f)
			}
			cfg.TLS.RootCAs = pool
		}
		switch cert, key := param("cert"), param("key"); {
		case (cert == "") != (key == ""):
			return fail("cert and key go together")
		case cert != "":
			cb, err := readBounded(cert, etcdMaxPEM, false)
			if err != nil {
				return fail("cert: %v", err)
			}
			kb, err := readBounded(key, etcdMaxPEM, false)
			if err != nil {
				return fail("key: %v", err)
			}
			pair, err := tls.X509KeyPair(cb, kb)
			if err != nil {
				return fail("cert %s and key %s: %v", cert, key, err)
			}
			cfg.TLS.Certificates = []tls.Certificate{pair}
		}
	}
	cfg.Username = param("user")
	if (cfg.Username == "") != (param("password-file") == "") {
		return fail("user and password-file go together")
	}
	if f := param("password-file"); f != "" {
		if cfg.Password, err = readPassword(f); err != nil {
			return fail("password-file: %v", err)
		}
	}
	scheme := "http://"
	if useTLS {
		scheme = "https://"
	}
	for hp := range strings.SplitSeq(hosts, ",") {
		host, port, err := net.SplitHostPort(hp)
		if err != nil {
			return fail("endpoint %q: %v", hp, err)
		}
		if n, err := strconv.ParseUint(port, 10, 16); host == "" || err != nil || n == 0 {
			return fail("endpoint %q: want HOST:PORT", hp)
		}
		cfg.Endpoints = append(cfg.Endpoints, scheme+net.JoinHostPort(host, port))
	}
	return cfg, nil
}

// readBounded reads file, failing when it holds more than max bytes or is
// not a regular file, or, when private, when its group or others may read
// or change it.
func readBounded(file string, max int64, private bool) ([]byte, error) {
	f, err := os.Open(file)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("%s is not a regular file", file)
	}
	if perm := st.Mode().Perm(); private && perm&0o077 != 0 {
		return nil, fmt.Errorf("%s has mode %04o: group or others may read or change it (chmod 600 %s)", file, perm, file)
	}
	b, err := io.ReadAll(io.LimitReader(f, max+1))
	if err != nil {
		return nil, err
	}
	if int64(len(b)) > max {
		return nil, fmt.Errorf("%s holds more than %d bytes", file, max)
	}
	return b, nil
}

// readPassword reads a password file: a regular file that its group and
// others may not read, of at most etcdMaxFile bytes, one trailing newline
// removed.
func readPassword(file string) (string, error) {
	b, err := readBounded(file, etcdMaxFile, true)
	if err != nil {
		return "", err
	}
	p := strings.TrimSuffix(strings.TrimSuffix(string(b), "\n"), "\r")
	if p == "" {
		return "", errors.New(file + " is empty")
	}
	return p, nil
}
