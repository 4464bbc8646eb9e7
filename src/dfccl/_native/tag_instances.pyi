# A tag's instances are C only (tag_instances.pxd): the hot path and the TagTable call them.
