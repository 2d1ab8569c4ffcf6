"""Views for people at a terminal: `snapshot` reads what there is to see, `top` draws it live."""
