"""pdserve kv_transfer (see ../shared/DESIGN.md): to be built by its issue."""
