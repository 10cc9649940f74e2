//! Per-backend builds of portable code: `simd_versions!` compiles one body with the AVX-512 F
//! and AVX2 features and dispatches on the backend, so every backend runs the same operations
//! in the same order and gives the same bits.

/// One portable body compiled for every x86-64 backend:
///
/// ```text
/// simd_versions! { #[attrs] vis fn name<G: Bound>(a: A, …) -> R = body; }
/// simd_versions! { #[attrs] vis fn name<G: Bound>(backend, a: A, …) -> R = body; }
/// ```
///
/// defines `vis fn name(a: A, …) -> R` (with `#[attrs]`), which calls `body(a, …)` inside a
/// `#[target_feature(enable = "avx512f")]` or `"avx2"` wrapper when the backend of the
/// installed settings is `Avx512` or `Avx2`, and plainly otherwise; the second form takes the
/// backend as its first argument (`backend: Backend`) instead. The wrappers compile exactly
/// `body`, so every backend runs the same operations in the same order (only the registers are
/// wider) and gives the same bits. A trailing `, wrappers #[attr]` puts `#[attr]` on both
/// wrappers.
///
/// The backend must be supported by this CPU: the settings only hold one that is, and the tests
/// pass only [`crate::Backend::available`] ones; that is what makes the wrappers' calls sound.
macro_rules! simd_versions {
    (
        $(#[$attr:meta])*
        $vis:vis fn $name:ident $(<$($gen:ident: $bound:path),+>)? (backend, $($arg:ident: $ty:ty),* $(,)?)
            $(-> $ret:ty)? = $body:ident $(, wrappers #[$wrap:meta])*;
    ) => {
        $(#[$attr])*
        #[allow(clippy::too_many_arguments)]
        $vis fn $name $(<$($gen: $bound),+>)? (backend: $crate::Backend, $($arg: $ty),*) $(-> $ret)? {
            #[cfg(not(target_arch = "x86_64"))]
            let _ = backend;
            $crate::simd::simd_versions!(@run backend, [$($($gen: $bound),+)?], ($($arg: $ty),*),
                [$(-> $ret)?], $body, [$(#[$wrap])*])
        }
    };
    (
        $(#[$attr:meta])*
        $vis:vis fn $name:ident $(<$($gen:ident: $bound:path),+>)? ($($arg:ident: $ty:ty),* $(,)?)
            $(-> $ret:ty)? = $body:ident $(, wrappers #[$wrap:meta])*;
    ) => {
        $(#[$attr])*
        #[allow(clippy::too_many_arguments)]
        $vis fn $name $(<$($gen: $bound),+>)? ($($arg: $ty),*) $(-> $ret)? {
            $crate::simd::simd_versions!(@run $crate::settings::backend(),
                [$($($gen: $bound),+)?], ($($arg: $ty),*), [$(-> $ret)?], $body, [$(#[$wrap])*])
        }
    };
    (@run $backend:expr, [$($gen:tt)*], ($($arg:ident: $ty:ty),*), [$($ret:tt)*], $body:ident,
        [$($wrap:tt)*]) => {{
        #[cfg(target_arch = "x86_64")]
        {
            #[target_feature(enable = "avx512f")]
            $($wrap)*
            #[allow(clippy::too_many_arguments)]
            unsafe fn avx512<$($gen)*>($($arg: $ty),*) $($ret)* {
                $body($($arg),*)
            }
            #[target_feature(enable = "avx2")]
            $($wrap)*
            #[allow(clippy::too_many_arguments)]
            unsafe fn avx2<$($gen)*>($($arg: $ty),*) $($ret)* {
                $body($($arg),*)
            }
            match $backend {
                // SAFETY: the backend is supported by this CPU (the macro's contract).
                $crate::Backend::Avx512 => return unsafe { avx512($($arg),*) },
                // SAFETY: as above.
                $crate::Backend::Avx2 => return unsafe { avx2($($arg),*) },
                _ => {}
            }
        }
        $body($($arg),*)
    }};
}
pub(crate) use simd_versions;
