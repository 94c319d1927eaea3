# Sourced by the device scripts that build kvq there: libmicrohttpd.pc
# requires gnutls.pc, which the device image lacks (and .deps does not
# carry); kvq links no gnutls symbol itself, so an empty stub satisfies
# pkg-config's check.
mkdir -p /tmp/kvq-pcstub
printf 'Name: gnutls\nDescription: stub for pkg-config (kvq device build)\nVersion: 3.7.9\nLibs:\nCflags:\n' \
  >/tmp/kvq-pcstub/gnutls.pc
export PKG_CONFIG_PATH=/tmp/kvq-pcstub${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
