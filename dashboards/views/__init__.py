"""One render function per dashboard page (rendering only; reads go through ``ui.PageContext``)."""
