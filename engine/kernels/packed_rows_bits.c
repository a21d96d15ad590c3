/*
 * The few-row kernels of one block for the formats with bit planes (Q5_0,
 * Q5_1, Q6_K): packed_rows.h's template, instantiated apart from
 * packed_rows.c so that the two compile at once on a first build.
 */
#include "packed_rows.h"

#ifdef METRALE_AVX2
ROWS_OF(rows_q5_0, FORMAT_Q5_0)
ROWS_OF(rows_q5_1, FORMAT_Q5_1)
ROWS_OF(rows_q6_k, FORMAT_Q6_K)
#endif
