"""The central team's side of the link: ingest every box's messages into a store, acknowledge
what is stored, track who is online, sign and send commands (`edge-agent fleet …`)."""
