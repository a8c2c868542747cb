"""WAN emulation for tests: hosts as network namespaces with shaped links (see docs/testing.md)."""
