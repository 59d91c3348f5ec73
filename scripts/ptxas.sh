#!/bin/sh
# ptxas.sh: print the path of an NVIDIA PTX assembler (ptxas), fetching one
# when there is none, so that nvlink's gather kernel (nvlink/kernel.go, PTX
# the driver compiles at run time) is assembled for real GPU architectures
# on a machine without a GPU or the CUDA toolkit (TestGatherPTXAssembles).
#
# It looks for ptxas on PATH, in /usr/local/cuda/bin, then in its cache
# (${XDG_CACHE_HOME:-$HOME/.cache}/moonring/ptxas). Else, on Debian as
# root, it downloads Debian's nvidia-cuda-toolkit package (the non-free
# component, about 84 MB) with a private apt configuration, leaving the
# system's sources and package state as they were, and keeps only ptxas
# from it in the cache. Nothing is installed.
#
#   scripts/ptxas.sh          print the path, fetching when needed
#   scripts/ptxas.sh --check  print the path if there is one (exit 1 if not)
set -eu

cache=${XDG_CACHE_HOME:-${HOME:-/root}/.cache}/moonring/ptxas
for p in "$(command -v ptxas 2>/dev/null || true)" /usr/local/cuda/bin/ptxas "$cache/ptxas"; do
	if [ -n "$p" ] && [ -x "$p" ]; then
		echo "$p"
		exit 0
	fi
done
if [ "${1:-}" = "--check" ]; then
	exit 1
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1 || ! command -v dpkg-deb >/dev/null 2>&1; then
	echo "ptxas.sh: no ptxas here, and fetching Debian's needs root and apt-get" >&2
	exit 1
fi
codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
if [ -z "$codename" ]; then
	echo "ptxas.sh: no Debian codename in /etc/os-release" >&2
	exit 1
fi
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
[ -f "$keyring" ] || {
	echo "ptxas.sh: no $keyring" >&2
	exit 1
}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/cache/archives/partial"
echo "deb [signed-by=$keyring] http://deb.debian.org/debian $codename non-free" >"$work/sources.list"
# The system's update hooks (appstream, packagekit, an image's cleaners)
# are not this update's business.
cat >"$work/apt.conf" <<'EOF2'
#clear APT::Update::Pre-Invoke;
#clear APT::Update::Post-Invoke;
#clear APT::Update::Post-Invoke-Success;
EOF2
set -- -q -c "$work/apt.conf" -o Dir::Etc::SourceList="$work/sources.list" -o Dir::Etc::SourceParts=/nonexistent \
	-o Dir::State::Lists="$work/lists" -o Dir::Cache="$work/cache" -o APT::Sandbox::User=root
echo "ptxas.sh: fetching ptxas from Debian's nvidia-cuda-toolkit ($codename non-free)" >&2
apt-get "$@" update >&2
(cd "$work" && apt-get "$@" download nvidia-cuda-toolkit >&2)
deb=$(ls "$work"/nvidia-cuda-toolkit_*.deb)
mkdir -p "$work/x" "$cache"
dpkg-deb --fsys-tarfile "$deb" | tar -xf - -C "$work/x" ./usr/bin/ptxas
cp "$work/x/usr/bin/ptxas" "$cache/ptxas.$$"
mv "$cache/ptxas.$$" "$cache/ptxas"
echo "$cache/ptxas"
