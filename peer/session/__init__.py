"""The session layer: a handshake-authenticated, AEAD-sealed TCP session to one peer that carries typed
messages (requests, replies) and tensors, and routes incoming messages to their handlers."""
