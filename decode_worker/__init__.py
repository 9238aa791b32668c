"""pdserve decode_worker (see ../shared/DESIGN.md): to be built by its issue."""
