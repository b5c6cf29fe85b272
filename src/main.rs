//! The `pinq` command line.
fn main() {
    println!("pinq");
}
