"""The fleet's tests, by side: protocol/, device/, controller/, sim/ (as edge_agent.fleet)."""
