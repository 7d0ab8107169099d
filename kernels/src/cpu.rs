//! Which instruction-set tiers this CPU runs, detected once per process. Each tier is a
//! proof token that only [`detect`] makes; every vector kernel takes the token of its tier
//! (or is handed out by a function that does), so no path can run instructions the CPU
//! lacks, and the portable code stays the reference each tier must equal bit for bit.
//! Benchmark tables name the CPU ([`model_name`]) and these tiers beside their figures.

use std::sync::OnceLock;

/// The tiers found on this CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Features {
    #[cfg(target_arch = "x86_64")]
    avx2: Option<Avx2>,
    #[cfg(target_arch = "x86_64")]
    avx_vnni: Option<AvxVnni>,
    #[cfg(target_arch = "x86_64")]
    avx512: Option<Avx512>,
    #[cfg(target_arch = "x86_64")]
    avx512_vnni: Option<Avx512Vnni>,
    #[cfg(target_arch = "x86_64")]
    avx512_bf16: Option<Avx512Bf16>,
    #[cfg(target_arch = "aarch64")]
    neon: Option<Neon>,
    #[cfg(target_arch = "aarch64")]
    neon_dotprod: Option<NeonDotprod>,
}

/// The environment variable that caps the tiers used (on x86-64 `portable`, `avx2`,
/// `avx-vnni`, `avx512`, `avx512-vnni` or `avx512-bf16`; on arm64 `portable`, `neon` or
/// `neon-dotprod`): to measure or test a lower tier on a CPU that has higher ones. A cap
/// keeps the tiers up to the one it names that the CPU has (`avx512` on a CPU with AVX-512
/// but no AVX-VNNI keeps AVX2 and AVX-512).
pub const TIER_CAP_VAR: &str = "FERRITE_CPU_TIER";

/// The tiers each name of [`TIER_CAP_VAR`] allows, lowest first.
#[cfg(target_arch = "x86_64")]
pub(crate) const TIER_NAMES: &[&str] = &[
    "portable",
    "avx2",
    "avx-vnni",
    "avx512",
    "avx512-vnni",
    "avx512-bf16",
];
/// The tiers each name of [`TIER_CAP_VAR`] allows, lowest first.
#[cfg(target_arch = "aarch64")]
pub(crate) const TIER_NAMES: &[&str] = &["portable", "neon", "neon-dotprod"];
/// The tiers each name of [`TIER_CAP_VAR`] allows, lowest first.
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
pub(crate) const TIER_NAMES: &[&str] = &["portable"];

/// The CPU's tiers, checked at the first call and remembered, capped by
/// [`TIER_CAP_VAR`] when it names a tier. On x86 the first call also sets how far ahead the
/// one-row dot products prefetch for this CPU's vendor (a hint, no effect on any result).
pub fn detect() -> Features {
    static FEATURES: OnceLock<Features> = OnceLock::new();
    *FEATURES.get_or_init(|| {
        let cap = std::env::var(TIER_CAP_VAR).ok();
        let tiers = cap
            .as_deref()
            .and_then(tiers_up_to)
            .unwrap_or(TIER_NAMES.len());
        #[cfg(target_arch = "x86_64")]
        crate::quant::sse2::tune_prefetch();
        Features::probe().capped(tiers)
    })
}

/// How the batch kernel of the 32-value formats (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1) runs on
/// this CPU, for benchmark tables and the startup log: `Some(true)` where two (weight row,
/// activation row) pairs sharing each 512-bit register do a block faster than a 256-bit
/// register per pair (a Zen 5, and Intel parts whose 256-bit operations share the ports of
/// the 512-bit ones); `Some(false)` where they do not (a CPU that splits 512-bit operations
/// in two), so each pair has a 256-bit register; `None` without the AVX-512 VNNI tier, which
/// that kernel needs. Measured once per process (a few microseconds) at the first call here
/// or in a product; it changes no result, only the time.
pub fn full_width_512() -> Option<bool> {
    #[cfg(target_arch = "x86_64")]
    {
        detect()
            .avx512_vnni()
            .map(crate::quant::avx512::wide::full_width)
    }
    #[cfg(not(target_arch = "x86_64"))]
    None
}

/// A [`full_width_512`] answer in the words benchmark tables, reports and the startup log
/// print: "paired in 512-bit registers", "in 256-bit registers", or "not used" (no AVX-512
/// VNNI tier).
pub fn full_width_512_words(full: Option<bool>) -> &'static str {
    match full {
        Some(true) => "paired in 512-bit registers",
        Some(false) => "in 256-bit registers",
        None => "not used",
    }
}

/// This CPU's model name as `/proc/cpuinfo` gives it, with its family and model numbers
/// where it gives them (x86): some VMs name only the vendor's line ("AMD EPYC"), which does
/// not tell one generation from the next. Empty where there is no `/proc/cpuinfo` or it
/// names no model (arm64's names neither): nothing is made up.
pub fn model_name() -> String {
    model_name_in(&std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default())
}

/// [`model_name`] from the text of `/proc/cpuinfo` (its first processor's fields).
fn model_name_in(cpuinfo: &str) -> String {
    let field = |name| cpuinfo_field(cpuinfo, name);
    let name = field("model name").unwrap_or_default();
    match (field("cpu family"), field("model")) {
        (Some(family), Some(model)) => format!("{name} (family {family}, model {model})"),
        _ => name,
    }
}

/// The value of the first `name : value` line of `/proc/cpuinfo` text whose name is exactly
/// `name` (so `model` does not find `model name`), trimmed.
pub(crate) fn cpuinfo_field(cpuinfo: &str, name: &str) -> Option<String> {
    cpuinfo
        .lines()
        .filter_map(|l| l.split_once(':'))
        .find(|(n, _)| n.trim() == name)
        .map(|(_, v)| v.trim().to_string())
}

/// How many tiers, from `portable` up, the name `cap` allows (`avx2`: 2).
fn tiers_up_to(cap: &str) -> Option<usize> {
    TIER_NAMES.iter().position(|&t| t == cap).map(|i| i + 1)
}

/// A [`TIER_CAP_VAR`] that names no tier, described for a startup error.
pub fn tier_cap_error() -> Option<String> {
    let cap = std::env::var(TIER_CAP_VAR).ok()?;
    (!TIER_NAMES.contains(&cap.as_str())).then(|| {
        format!(
            "{TIER_CAP_VAR}={cap:?} names no instruction-set tier; use one of {}",
            TIER_NAMES.join(", ")
        )
    })
}

impl Features {
    #[cfg(target_arch = "x86_64")]
    fn probe() -> Self {
        use std::arch::is_x86_feature_detected as has;
        let avx2 = (has!("avx2") && has!("fma") && has!("f16c")).then_some(Avx2(()));
        let avx_vnni = avx2.filter(|_| has!("avxvnni")).map(|_| AvxVnni(()));
        let avx512 = avx2
            .filter(|_| has!("avx512f") && has!("avx512bw") && has!("avx512vl"))
            .map(|_| Avx512(()));
        let avx512_vnni = avx512
            .filter(|_| has!("avx512vnni"))
            .map(|_| Avx512Vnni(()));
        let avx512_bf16 = avx512_vnni
            .filter(|_| has!("avx512bf16"))
            .map(|_| Avx512Bf16(()));
        Features {
            avx2,
            avx_vnni,
            avx512,
            avx512_vnni,
            avx512_bf16,
        }
    }

    #[cfg(target_arch = "aarch64")]
    fn probe() -> Self {
        use std::arch::is_aarch64_feature_detected as has;
        let neon = has!("neon").then_some(Neon(()));
        let neon_dotprod = neon.filter(|_| has!("dotprod")).map(|_| NeonDotprod(()));
        Features { neon, neon_dotprod }
    }

    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    fn probe() -> Self {
        Features {}
    }

    /// These tiers without those above the `tiers`-th of [`TIER_NAMES`] (0: portable only).
    pub(crate) fn capped(self, tiers: usize) -> Self {
        let _ = tiers;
        #[cfg(target_arch = "x86_64")]
        {
            let mut f = self;
            if tiers < 2 {
                f.avx2 = None;
            }
            if tiers < 3 {
                f.avx_vnni = None;
            }
            if tiers < 4 {
                f.avx512 = None;
            }
            if tiers < 5 {
                f.avx512_vnni = None;
            }
            if tiers < 6 {
                f.avx512_bf16 = None;
            }
            f
        }
        #[cfg(target_arch = "aarch64")]
        {
            let mut f = self;
            if tiers < 2 {
                f.neon = None;
            }
            if tiers < 3 {
                f.neon_dotprod = None;
            }
            f
        }
        #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
        self
    }

    /// AVX2 with FMA and F16C (x86-64-v3), if present.
    #[cfg(target_arch = "x86_64")]
    pub fn avx2(self) -> Option<Avx2> {
        self.avx2
    }

    /// AVX-VNNI's 256-bit integer dot products (`vpdpbusd` with a VEX encoding, on Intel
    /// client parts from Alder Lake and on Zen 4 and later) with the AVX2 tier, if present.
    #[cfg(target_arch = "x86_64")]
    pub fn avx_vnni(self) -> Option<AvxVnni> {
        self.avx_vnni
    }

    /// AVX-512 F, BW and VL (with the AVX2 tier), if present.
    #[cfg(target_arch = "x86_64")]
    pub fn avx512(self) -> Option<Avx512> {
        self.avx512
    }

    /// AVX-512 with VNNI's integer dot products, if present.
    #[cfg(target_arch = "x86_64")]
    pub fn avx512_vnni(self) -> Option<Avx512Vnni> {
        self.avx512_vnni
    }

    /// AVX-512 BF16's `vdpbf16ps` (with the VNNI tier), if present.
    #[cfg(target_arch = "x86_64")]
    pub fn avx512_bf16(self) -> Option<Avx512Bf16> {
        self.avx512_bf16
    }

    /// NEON (Advanced SIMD), which every arm64 CPU has, if present.
    #[cfg(target_arch = "aarch64")]
    pub fn neon(self) -> Option<Neon> {
        self.neon
    }

    /// NEON with the dot product instructions (`sdot`, Armv8.2's DotProd), if present.
    #[cfg(target_arch = "aarch64")]
    pub fn neon_dotprod(self) -> Option<NeonDotprod> {
        self.neon_dotprod
    }

    /// The tiers present, lowest first (`portable` always), as benchmark tables and kernel
    /// tests name them.
    pub fn tiers(self) -> Vec<&'static str> {
        #[cfg_attr(
            not(any(target_arch = "x86_64", target_arch = "aarch64")),
            allow(unused_mut)
        )]
        let mut tiers = vec!["portable"];
        #[cfg(target_arch = "x86_64")]
        {
            tiers.extend(self.avx2.map(|_| "avx2"));
            tiers.extend(self.avx_vnni.map(|_| "avx-vnni"));
            tiers.extend(self.avx512.map(|_| "avx512"));
            tiers.extend(self.avx512_vnni.map(|_| "avx512-vnni"));
            tiers.extend(self.avx512_bf16.map(|_| "avx512-bf16"));
        }
        #[cfg(target_arch = "aarch64")]
        {
            tiers.extend(self.neon.map(|_| "neon"));
            tiers.extend(self.neon_dotprod.map(|_| "neon-dotprod"));
        }
        tiers
    }
}

/// A token of a tier whose integer kernels it shares with the tier below it, saying whether
/// it adds a byte dot-product instruction (four byte products summed into each 32-bit lane:
/// `vpdpbusd` on `avx-vnni` over `avx2`, `sdot` on `neon-dotprod` over `neon`). Such kernels
/// take either token and use the instruction where `DOT`.
pub(crate) trait ByteDot: Copy {
    /// Whether this tier has the byte dot-product instruction.
    const DOT: bool;
}

#[cfg(target_arch = "x86_64")]
impl ByteDot for Avx2 {
    const DOT: bool = false;
}

#[cfg(target_arch = "x86_64")]
impl ByteDot for AvxVnni {
    const DOT: bool = true;
}

#[cfg(target_arch = "aarch64")]
impl ByteDot for Neon {
    const DOT: bool = false;
}

#[cfg(target_arch = "aarch64")]
impl ByteDot for NeonDotprod {
    const DOT: bool = true;
}

/// Proof that the CPU runs AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Avx2(());

/// Proof that the CPU runs AVX-VNNI (`vpdpbusd` on 256-bit registers), and the AVX2 tier.
#[cfg(target_arch = "x86_64")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AvxVnni(());

/// Proof that the CPU runs AVX-512 F, BW and VL, and the AVX2 tier.
#[cfg(target_arch = "x86_64")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Avx512(());

/// Proof that the CPU runs AVX-512 VNNI, and the AVX-512 tier.
#[cfg(target_arch = "x86_64")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Avx512Vnni(());

/// Proof that the CPU runs AVX-512 BF16 (`vdpbf16ps`), and the AVX-512 VNNI tier.
#[cfg(target_arch = "x86_64")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Avx512Bf16(());

/// Proof that the CPU runs NEON (Advanced SIMD, with its fused multiply-adds).
#[cfg(target_arch = "aarch64")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Neon(());

/// Proof that the CPU runs NEON's dot product instructions (`sdot`), and the NEON tier.
#[cfg(target_arch = "aarch64")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NeonDotprod(());

#[cfg(target_arch = "aarch64")]
impl NeonDotprod {
    /// The NEON tier below it.
    pub fn neon(self) -> Neon {
        Neon(())
    }
}

#[cfg(target_arch = "x86_64")]
impl Avx512Bf16 {
    /// The AVX-512 tier below it.
    pub fn avx512(self) -> Avx512 {
        Avx512(())
    }
}

#[cfg(target_arch = "x86_64")]
impl Avx512 {
    /// The AVX2 tier, which every AVX-512 CPU found here also has.
    pub fn avx2(self) -> Avx2 {
        Avx2(())
    }
}

#[cfg(target_arch = "x86_64")]
impl Avx512Vnni {
    /// The AVX-512 tier below it.
    pub fn avx512(self) -> Avx512 {
        Avx512(())
    }

    /// The AVX2 tier.
    pub fn avx2(self) -> Avx2 {
        Avx2(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_model_name_carries_its_family_and_model_where_cpuinfo_has_them() {
        let zen5 = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\n\
                    model\t\t: 2\nmodel name\t: AMD EPYC\nstepping\t: 1\n";
        assert_eq!(model_name_in(zen5), "AMD EPYC (family 26, model 2)");
        // arm64's cpuinfo has neither a model name nor a family: nothing is made up.
        assert_eq!(model_name_in("processor\t: 0\nCPU part\t: 0xd0c\n"), "");
    }

    #[test]
    fn tiers_nest_and_are_named_lowest_first() {
        let f = detect();
        let tiers = f.tiers();
        assert_eq!(tiers[0], "portable");
        #[cfg(target_arch = "x86_64")]
        {
            assert!(f.avx512().is_none() || f.avx2().is_some());
            assert!(f.avx_vnni().is_none() || f.avx2().is_some());
            assert!(f.avx512_vnni().is_none() || f.avx512().is_some());
            assert!(f.avx512_bf16().is_none() || f.avx512_vnni().is_some());
            assert_eq!(
                tiers.len(),
                1 + usize::from(f.avx2().is_some())
                    + usize::from(f.avx_vnni().is_some())
                    + usize::from(f.avx512().is_some())
                    + usize::from(f.avx512_vnni().is_some())
                    + usize::from(f.avx512_bf16().is_some())
            );
        }
        #[cfg(target_arch = "aarch64")]
        {
            assert!(f.neon_dotprod().is_none() || f.neon().is_some());
            assert_eq!(
                tiers.len(),
                1 + usize::from(f.neon().is_some()) + usize::from(f.neon_dotprod().is_some())
            );
        }
        tell!("kernel tiers this CPU runs: {}", tiers.join(", "));
    }

    #[test]
    fn a_cap_drops_every_tier_above_it() {
        let all = Features::probe();
        assert_eq!(all.capped(1).tiers(), ["portable"]);
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = all.capped(2);
            assert!(avx2.avx_vnni().is_none() && avx2.avx512().is_none());
            assert!(avx2.avx512_vnni().is_none());
            assert_eq!(all.capped(3).avx_vnni(), all.avx_vnni());
            assert!(all.capped(3).avx512().is_none());
            assert!(all.capped(5).avx512_bf16().is_none());
            assert_eq!(avx2.avx2(), all.avx2());
        }
        #[cfg(target_arch = "aarch64")]
        {
            assert!(all.capped(1).neon().is_none());
            assert!(all.capped(2).neon_dotprod().is_none());
            assert_eq!(all.capped(2).neon(), all.neon());
        }
        assert_eq!(all.capped(TIER_NAMES.len()), all);
        // A name allows its own tier and those below it.
        assert_eq!(tiers_up_to("portable"), Some(1));
        #[cfg(target_arch = "x86_64")]
        {
            assert_eq!(tiers_up_to("avx2"), Some(2));
            assert_eq!(tiers_up_to("avx-vnni"), Some(3));
            assert_eq!(tiers_up_to("avx512-vnni"), Some(5));
            assert_eq!(tiers_up_to("avx512-bf16"), Some(6));
            assert_eq!(tiers_up_to("neon"), None);
        }
        #[cfg(target_arch = "aarch64")]
        {
            assert_eq!(tiers_up_to("neon"), Some(2));
            assert_eq!(tiers_up_to("neon-dotprod"), Some(3));
            assert_eq!(tiers_up_to("avx2"), None);
        }
        assert_eq!(tiers_up_to("sse9"), None);
        #[cfg(target_arch = "x86_64")]
        if all.avx2().is_some() {
            let capped = all.capped(2);
            assert_eq!(capped.tiers(), ["portable", "avx2"]);
        }
    }
}
