"""peertrain's wire protocol, sans-I/O.

Everything here turns bytes into events and events into bytes. Nothing in this
package opens a socket, reads a clock or imports trio: that keeps the protocol
easy to test exhaustively and to fuzz (see tests/test_protocol_*.py).
"""

PROTOCOL_VERSION = 1
