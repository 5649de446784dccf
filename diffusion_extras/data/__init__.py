"""Images in: dataset dispatch, the embedded digits, decode-once cache, (seed, step) batch order,
and the data sources the loop reads (cached or streamed) behind one interface."""
