/* Event kinds, for the C accelerators: the numbers of coalesce/_kinds.py
 * (OPAQUE, STORED, REMOVED, CLEARED), defined once for Python and C.
 * tests/test_kinds.py parses this file and checks each number against
 * _kinds.py, and that no other file of the package defines them again. */
#ifndef COALESCE_KINDS_H
#define COALESCE_KINDS_H

enum { K_OPAQUE = 0, K_STORED = 1, K_REMOVED = 2, K_CLEARED = 3 };

#endif
